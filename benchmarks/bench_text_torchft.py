"""The real-text benchmark's peer: one learner as a torchft replica running DiLoCo.

Each learner process is its own replica group of one (rank 0, world size 1) with its own
``TCPStore`` on 127.0.0.1, a gloo process group, and a ``torchft.Manager`` that joins the
lighthouse the runner started; it is set up as torchft's ``train_diloco.py`` example sets
it up (gloo timeout 10 s, manager timeout 30 s, ``min_replica_size=1``, synchronous quorum,
an ``HTTPTransport`` for healing with a 10 s timeout), with ``init_sync=False``
(``manager_options``): every learner starts from the same seed. ``torchft.local_sgd.DiLoCo``
wraps the inner optimizer (the same AdamW and schedule as every other arm) over the same
fragments gradientmail makes (``fragments.signature`` with the run's pattern; each fragment
is a module holding those very parameters) with one outer ``SGD(lr, momentum,
nesterov=True)`` per fragment, the rate and momentum the spec names.
``fragment_sync_delay`` is 0 (a fragment's all-reduce is waited for at its sync step) and
nothing is quantized (fp32). A learner restarted after a kill heals before its first step
(``heal``). Its final model is saved for the runner's one evaluation
(``bench_text_eval``).

The report adds to the learner's: its syncs and failed syncs (a sync step after which the
manager's step did not advance: the fragment went back to its last committed value), the
participants of each sync, the bytes handed to the process group's all-reduce
(**measured** by wrapping the group: ``counting_gloo``), the traffic a ring all-reduce of
them sends and receives (``2 × 2 (p − 1) / p × bytes`` for ``p`` participants: computed from
the measured bytes, gloo's own sockets being out of Python's reach), and for a restarted
learner the moment it first held the group's model (its heal).
"""

import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _launch import wait_for
from _workers import Learning, Progress
from bench_text_training import learning as text_learning


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _fragments(model: Any, count: int) -> list[Any]:
    """One module per gradientmail fragment holding the model's own parameters."""
    from torch import nn

    from gradientmail.protocol.fragments import signature

    named = list(model.named_parameters())
    by_name = dict(named)
    modules = []
    for spec in signature(named, count, "contiguous"):
        holder = nn.Module()
        for param in spec.params:
            holder.register_parameter(param.name.replace(".", "__"), by_name[param.name])
        modules.append(holder)
    return modules


def manager_options(spec: dict[str, Any], index: int, port: int) -> dict[str, Any]:
    """The keyword arguments of learner ``index``'s ``torchft.Manager`` but its process group,
    state-dict functions and checkpoint transport: ``init_sync=False``, as torchft's
    docstring asks when every replica starts from the same seed (as here: with its default,
    the first quorum overwrites every learner's state with one learner's)."""
    return {
        "use_async_quorum": False,
        "min_replica_size": 1,
        "replica_id": f"learner_{index}",
        "store_addr": "127.0.0.1",
        "store_port": port,
        "rank": 0,
        "world_size": 1,
        "lighthouse_addr": spec["lighthouse"],
        "hostname": "127.0.0.1",
        "timeout": timedelta(seconds=30),
        "init_sync": False,
    }


def counting_gloo(timeout: timedelta) -> Any:
    """torchft's gloo process group, counting what each all-reduce is handed: its
    ``allreduces`` list holds ``(bytes, participants)`` per call (the participants being the
    world size of the group as last configured)."""
    from torchft.process_group import ProcessGroupGloo

    class CountingGloo(ProcessGroupGloo):
        def __init__(self) -> None:
            super().__init__(timeout=timeout)
            self.allreduces: list[tuple[int, int]] = []
            self.participants = 1

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            *rest: Any,
            **named: Any,
        ) -> None:
            self.participants = world_size
            super().configure(store_addr, replica_id, rank, world_size, *rest, **named)

        def allreduce(self, tensors: list[Any], opts: object) -> Any:
            size = sum(t.numel() * t.element_size() for t in tensors)
            self.allreduces.append((size, self.participants))
            return super().allreduce(tensors, opts)

    return CountingGloo()


def heal(manager: Any, diloco: Any) -> None:
    """A restarted learner's first act: join the survivors' next fragment sync before any
    step, as torchft's own step hook would at a sync step (``DiLoCo._step_post_hook``): the
    quorum heals it from a peer (model, inner and outer optimizers, manager step), then it
    takes its part in that fragment's all-reduce (contributing its source's pseudo-gradient,
    torchft's behaviour for a replica healed in a sync quorum)."""
    manager.start_quorum()
    fragment = diloco._fragments[diloco._current_fragment()]
    fragment.prepare_sync()
    fragment.perform_sync()


def _outer_optimizers(modules: list[Any], spec: dict[str, Any]) -> list[Any]:
    """One outer Nesterov SGD per fragment module, at the spec's rate and momentum."""
    import torch

    return [
        torch.optim.SGD(
            m.parameters(), lr=spec["outer_lr"], momentum=spec["outer_momentum"], nesterov=True
        )
        for m in modules
    ]


def _manager(
    spec: dict[str, Any], index: int, model: Any, inner: Any, outer: list[Any]
) -> tuple[Any, Any, Any]:
    """Learner ``index``'s ``torchft.Manager`` over its own ``TCPStore`` and a counting gloo
    group, healing the model and both optimizers; the manager, the group and the store (to
    be kept alive until the manager shuts down)."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.checkpointing.http_transport import HTTPTransport

    def state_dict() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "inner_optim": inner.state_dict(),
            "outer_optim": [o.state_dict() for o in outer],
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])
        for optimizer, saved in zip(outer, state["outer_optim"], strict=True):
            optimizer.load_state_dict(saved)

    port = _free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    group = counting_gloo(timedelta(seconds=10))
    manager = Manager(
        pg=group,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0),
        **manager_options(spec, index, port),
    )
    return manager, group, store


class _Syncs:
    """A learner's fragment syncs, as its steps end on them (``after_step``, on the training
    thread): for each, its step, fragment, participants, manager step and whether it
    committed; and when the learner first held the group's model."""

    def __init__(self, manager: Any, progress: Progress, spec: dict[str, Any]) -> None:
        self._manager = manager
        self._progress = progress
        self._fragments = spec["fragments"]
        self._period = spec["sync_every"] // spec["fragments"]
        self._manager_step = manager.current_step()
        self._local = 0
        self.log: list[dict[str, Any]] = []
        self.group_model_at: list[float] = []

    def after_step(self) -> None:
        self._progress.step()
        self._local += 1
        if self._local % self._period:
            return
        step = self._manager.current_step()
        committed = step > self._manager_step
        self.log.append(
            {
                "step": self._progress.done,
                "fragment": self._manager_step % self._fragments,
                "committed": committed,
                "participants": self._manager.num_participants(),
                "manager_step": step,
            }
        )
        if committed and not self.group_model_at:
            self.group_model_at.append(time.monotonic())
        self._manager_step = step

    def healed(self) -> None:
        """The learner holds the group's model now, at the manager's step."""
        self._manager_step = self._manager.current_step()
        self.group_model_at.append(time.monotonic())


def _every_learner_ready(scratch: Path, index: int, learners: int) -> None:
    (scratch / f"ready-{index}").touch()
    wait_for(
        lambda: all((scratch / f"ready-{k}").exists() for k in range(learners)),
        120.0,
        "every learner to start",
    )


def _traffic(group: Any, syncs: _Syncs) -> dict[str, Any]:
    """A learner's syncs and the bytes its group's all-reduces were handed and moved."""
    # A ring all-reduce of n bytes over p participants sends and receives 2 (p - 1) / p × n
    # bytes at each: both count, as gradientmail's bytes written and read both do.
    ring = [2 * 2 * (p - 1) / p * size for size, p in group.allreduces if p > 0]
    return {
        "syncs": len(syncs.log),
        "failed_syncs": sum(1 for s in syncs.log if not s["committed"]),
        "sync_log": syncs.log,
        "allreduce_payload_bytes": sum(size for size, _ in group.allreduces),
        "allreduce_calls": len(group.allreduces),
        "allreduce_bytes": sum(ring),
        "group_model_at": syncs.group_model_at[0] if syncs.group_model_at else None,
    }


def worker(spec: dict[str, Any], index: int, learning: Learning | None = None) -> dict[str, Any]:
    """Train learner ``index`` under torchft's DiLoCo (``learning``: what it trains,
    ``bench_text_training.learning``'s when None); its report."""
    import torch
    from torchft.local_sgd import DiLoCo

    scratch = Path(spec["scratch"])
    learning = learning or text_learning(spec, index)
    model, inner = learning.model, learning.optimizer
    modules = _fragments(model, spec["fragments"])
    outer = _outer_optimizers(modules, spec)
    manager, group, store = _manager(spec, index, model, inner, outer)
    progress = Progress(scratch, index)
    syncs = _Syncs(manager, progress, spec)
    _every_learner_ready(scratch, index, spec["learners"])
    started = time.perf_counter()
    with DiLoCo(
        manager,
        modules,
        inner,
        outer,
        sync_every=spec["sync_every"],
        backup_device=torch.device("cpu"),
        pin_memory=False,
    ) as diloco:
        if progress.first > 0:
            heal(manager, diloco)
            syncs.healed()
        curve = learning.train(progress.first, syncs.after_step)
    trained = time.perf_counter() - started
    final = learning.final()
    manager.shutdown(wait=False)
    del store
    return progress.report(index, spec["steps"], curve, final, trained) | _traffic(group, syncs)
