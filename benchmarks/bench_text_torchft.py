"""The real-text benchmark's peer: one learner as a torchft replica running DiLoCo.

Each learner process is its own replica group of one (rank 0, world size 1) with its own
``TCPStore`` on 127.0.0.1, a gloo process group, and a ``torchft.Manager`` that joins the
lighthouse the runner started; it is set up as torchft's ``train_diloco.py`` example sets
it up (gloo timeout 10 s, manager timeout 30 s, ``min_replica_size=1``, synchronous quorum,
an ``HTTPTransport`` for healing with a 10 s timeout). ``torchft.local_sgd.DiLoCo`` wraps
the inner optimizer (the same AdamW and schedule as every other arm) over the same fragments
gradientmail makes (``fragments.signature`` with the run's pattern; each fragment is a
module holding those very parameters) with one outer ``SGD(lr, momentum, nesterov=True)``
per fragment: gradientmail's outer step, bit for bit. ``fragment_sync_delay`` is 0 (a
fragment's all-reduce is waited for at its sync step) and nothing is quantized (fp32).

The report adds to the learner's: its syncs and failed syncs (a sync step after which the
manager's step did not advance: the fragment went back to its last committed value), the
participants of each sync, the all-reduce bytes those syncs move by a ring all-reduce
(``2 (p − 1) / p × 4 × numel`` for ``p`` participants: computed, torchft does not count
them), and for a restarted learner the moment it first held the group's model (its first
committed sync, which heals it from a peer).
"""

import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import bench_convergence as bc
import bench_text as bt


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _fragments(model: Any, count: int) -> tuple[list[Any], list[int]]:
    """One module per gradientmail fragment holding the model's own parameters, and each
    fragment's element count."""
    from torch import nn

    from gradientmail.protocol.fragments import signature

    named = list(model.named_parameters())
    by_name = dict(named)
    modules, sizes = [], []
    for spec in signature(named, count, "contiguous"):
        holder = nn.Module()
        for param in spec.params:
            holder.register_parameter(param.name.replace(".", "__"), by_name[param.name])
        modules.append(holder)
        sizes.append(spec.numel)
    return modules, sizes


def worker(spec: dict[str, Any], index: int, learning: bc.Learning | None = None) -> dict[str, Any]:
    """Train learner ``index`` under torchft's DiLoCo (``learning``: what it trains,
    ``bench_text.learning``'s when None); its report."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    scratch = Path(spec["scratch"])
    learning = learning or bt.learning(spec, index)
    model, inner = learning.model, learning.optimizer
    modules, sizes = _fragments(model, spec["fragments"])
    outer = [
        torch.optim.SGD(
            m.parameters(), lr=spec["outer_lr"], momentum=spec["outer_momentum"], nesterov=True
        )
        for m in modules
    ]

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
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        use_async_quorum=False,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"learner_{index}",
        store_addr="127.0.0.1",
        store_port=port,
        rank=0,
        world_size=1,
        lighthouse_addr=spec["lighthouse"],
        hostname="127.0.0.1",
        timeout=timedelta(seconds=30),
        checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0),
    )
    progress = bc.Progress(scratch, index)
    period = spec["sync_every"] // spec["fragments"]
    syncs: list[dict[str, Any]] = []
    state = {"manager_step": manager.current_step(), "local": 0}
    group_model_at: list[float] = []

    def after_step() -> None:
        progress.step()
        state["local"] += 1
        if state["local"] % period:
            return
        step = manager.current_step()
        committed = step > state["manager_step"]
        participants = manager.num_participants()
        fragment = state["manager_step"] % spec["fragments"]
        syncs.append(
            {
                "step": progress.done,
                "fragment": fragment,
                "committed": committed,
                "participants": participants,
                "manager_step": step,
            }
        )
        if committed and not group_model_at:
            group_model_at.append(time.monotonic())
        state["manager_step"] = step

    (scratch / f"ready-{index}").touch()
    bc.wait_for(
        lambda: all((scratch / f"ready-{k}").exists() for k in range(spec["learners"])),
        120.0,
        "every learner to start",
    )
    started = time.perf_counter()
    with DiLoCo(
        manager,
        modules,
        inner,
        outer,
        sync_every=spec["sync_every"],
        backup_device=torch.device("cpu"),
        pin_memory=False,
    ):
        curve = learning.train(progress.first, after_step)
    trained = time.perf_counter() - started
    final = learning.final()
    manager.shutdown(wait=False)
    del store
    ring = [
        2 * (s["participants"] - 1) / s["participants"] * 4 * sizes[s["fragment"]]
        for s in syncs
        if s["committed"] and s["participants"] > 0
    ]
    return progress.report(index, spec["steps"], curve, final, trained) | {
        "syncs": len(syncs),
        "failed_syncs": sum(1 for s in syncs if not s["committed"]),
        "sync_log": syncs,
        "allreduce_bytes": sum(ring),
        "group_model_at": group_model_at[0] if group_model_at else None,
    }
