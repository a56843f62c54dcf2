"""Convergence and bytes: gradientmail against synchronous data-parallel training.

The demo's transformer (its ``tiny`` shape, about 28k parameters, so that the whole matrix
fits the time budget on two cores) learns the demo's Markov language, whose entropy floor is
known exactly. Every arm sees the same sequences: learner ``k`` trains on shard ``k`` of the
corpus, and data-parallel's step ``t`` is the union of the learners' step-``t`` batches.

- ``dp``: one process, batch ``K × b``, the reference. Its bytes are what a ring all-reduce
  of fp32 gradients would move per learner, ``2 (K − 1) / K × 4 × params`` per step:
  computed, not measured.
- ``gm-{encoding}-H{H}``: ``K`` learner processes and one dedicated syncer process on a
  ``LocalMailbox``, ``F`` fragments, deltas and updates in ``encoding``, grace 3 s (longer
  than the learners drift apart with five processes on two cores, so that a round does not
  close without one of them; learners never wait on a round). A learner's bytes
  are measured by its node (``node.state``: bytes written and read) from the moment all
  learners have joined to the end of its closing flush; the syncer's are reported apart.
- ``single``: one learner, batch ``b``, the same steps (a quarter of the tokens).

Every arm uses AdamW (the inner optimizer for gradientmail) with the same learning-rate
schedule (linear warm-up, cosine decay to a tenth). Final evaluation loss is measured on a
fixed held-out set; excess is that minus the floor. Each gradientmail learner evaluates its
local model; the final figure is the mean over learners after the closing flush (they then
hold the same committed versions).

Usage: ``.venv/bin/python benchmarks/bench_convergence.py [--quick] [--results DIR]``.
The learner and syncer processes run this file with ``--worker``.

``--grid`` runs the defaults grid instead: one gradientmail run per point of outer lr ×
outer momentum × H × (quorum fraction, grace), seed 0, against data-parallel and a single
learner of the same seed, into ``convergence-grid.json``; ``--outer-lr``,
``--outer-momentum``, ``--sync-every``, ``--quorum F:G`` and ``--encoding`` set the axes
(``GRID`` has the defaults, 54 points: about 40 s each at full size on two idle cores).

``--long STEPS`` measures only bytes: int8 at H = 50 for ``STEPS`` steps, once per
``--checkpoint-every`` value (default 1 and 8), into ``convergence-bytes.json``: long
enough that the closing flush is a small share of a learner's bytes (reported).
"""

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as h
import msgspec

NAME = "convergence"
K = 4
FRAGMENTS = 4
BATCH = 16
CONTEXT = 32
LR = 3e-3
WARMUP_FRACTION = 0.05
EVAL_BATCHES = 4
EVAL_BATCH_SIZE = 64
FINAL_EVAL_BATCHES = 16
TARGETS: tuple[dict[str, Any], ...] = (
    {"arm": "gm-int8-H50", "excess_ratio_max": 1.10, "bytes_ratio_min": 150.0},
    {"arm": "gm-int4-H100", "excess_ratio_max": 1.20, "bytes_ratio_min": 400.0},
)
PUBLISHED_GAP_PERCENT = 2.0
"""Streaming DiLoCo's relative loss gap to data-parallel at 4 replicas, small model."""


def plan(quick: bool) -> dict[str, Any]:
    """Steps, seeds and the gradientmail matrix.

    The full run repeats the reference arms and the two headline settings over three seeds
    and runs the rest of the matrix (every encoding at every H) on the first seed: the whole
    matrix over three seeds is 27 runs of five processes, which does not fit the 20-minute
    budget on two cores. The quick variant: one short seed, int8 at H=12 only.
    """
    if quick:
        return {
            "steps": 40,
            "seeds": [0],
            "sync_every": [12],
            "encodings": ["int8"],
            "repeated": [],
            "eval_every": 20,
        }
    return {
        "steps": 300,
        "seeds": [0, 1, 2],
        "sync_every": [25, 50, 100],
        "encodings": ["fp32", "int8", "int4"],
        "repeated": [target["arm"] for target in TARGETS],
        "eval_every": 50,
    }


def model_config() -> Any:
    from gradientmail.demo.model import GPTConfig

    return GPTConfig.tiny(vocab_size=64, context=CONTEXT)


def lr_at(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to LR / 10."""
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: Any,
    batches: Iterator[Any],
    *,
    steps: int,
    eval_every: int,
    evaluation: list[Any],
    after_step: Callable[[], None] = lambda: None,
    first: int = 0,
    lr: float = LR,
    optimizer: Any = None,
) -> list[list[float]]:
    """Steps ``first .. steps - 1`` on ``batches`` at peak learning rate ``lr`` (``lr_at``'s
    schedule over ``steps``) with ``optimizer`` (a new AdamW when None), calling
    ``after_step`` after each; the evaluation loss every ``eval_every`` steps, as
    ``[step, loss]`` pairs (step ``first`` first)."""
    import torch

    from gradientmail.demo.data import evaluate

    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve = [[float(first), evaluate(model, evaluation)]]
    for step in range(first, steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps) * lr / LR
        loss = model.loss(next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        after_step()
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            curve.append([float(step + 1), evaluate(model, evaluation)])
    return curve


def _union(streams: list[Iterator[Any]]) -> Iterator[Any]:
    import torch

    while True:
        yield torch.cat([next(stream) for stream in streams])


def run_local(arm: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The ``dp`` or ``single`` arm, in this process on one thread."""
    import torch

    from gradientmail.demo.data import evaluate, synthetic
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    corpus = synthetic(length=CONTEXT, seed=seed)
    evaluation = corpus.evaluation(batches=EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=CONTEXT)
    final_set = corpus.evaluation(
        batches=FINAL_EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=CONTEXT
    )
    model = GPT(model_config(), seed=seed)
    learners = K if arm == "dp" else 1
    streams = [corpus.train(k, batch_size=BATCH, length=CONTEXT) for k in range(learners)]
    started = time.perf_counter()
    curve = train(
        model,
        _union(streams),
        steps=settings["steps"],
        eval_every=settings["eval_every"],
        evaluation=evaluation,
    )
    seconds = time.perf_counter() - started
    final = evaluate(model, final_set)
    params = model.num_parameters()
    assert corpus.floor is not None
    result: dict[str, Any] = {
        "final_loss": final,
        "excess": final - corpus.floor,
        "floor": corpus.floor,
        "curve": [*curve, [float(settings["steps"]), final]],
        "tokens_per_step": learners * BATCH * CONTEXT,
        "seconds": seconds,
        "params": params,
    }
    if arm == "dp":
        result["bytes_per_learner_computed"] = 2 * (K - 1) / K * 4 * params * settings["steps"]
    return result


# -- gradientmail: the worker processes (shared with bench_text.py) ---------------------


POLL = 0.05
"""The workers' ``poll_interval`` unless the spec names one: a step here takes milliseconds,
so a round comes every few tenths of a second."""
LEASE_EVERY = 0.5
LEASE_TIMEOUT = 5.0
"""The workers' lease pacing unless the spec names one: a killed learner counts as gone
within seconds of this benchmark's short runs."""


def _options(*, syncer: bool, spec: dict[str, Any]) -> Any:
    """The nodes' options: the spec's pacing (``poll_interval``, ``due_poll_interval``,
    ``lease_every``, ``lease_timeout``) where it names one, else this benchmark's (the
    product's due poll)."""
    from gradientmail._node import NodeOptions

    return NodeOptions(
        poll_interval=spec.get("poll_interval", POLL),
        due_poll_interval=spec.get("due_poll_interval", NodeOptions().due_poll_interval),
        lease_every=spec.get("lease_every", LEASE_EVERY),
        lease_timeout=spec.get("lease_timeout", LEASE_TIMEOUT),
        claim_timeout=10.0,
        creation_timeout=20.0,
        close_timeout=30.0,
        syncer=syncer,
    )


SPARSE: dict[str, dict[str, Any]] = {
    "topk1": {"topk_density": 0.01, "outer_momentum": 0.0, "outer_lr": 2.0},
    "topk3": {"topk_density": 0.03, "outer_momentum": 0.0, "outer_lr": 2.0},
    "topk1lr1": {"topk_density": 0.01, "outer_momentum": 0.0},
    "topk3lr1": {"topk_density": 0.03, "outer_momentum": 0.0},
    "topk1lr4": {"topk_density": 0.01, "outer_momentum": 0.0, "outer_lr": 4.0},
    "topk3lr4": {"topk_density": 0.03, "outer_momentum": 0.0, "outer_lr": 4.0},
    "topk3lr8": {"topk_density": 0.03, "outer_momentum": 0.0, "outer_lr": 8.0},
    "topk1nag": {"topk_density": 0.01, "update_encoding": "int8"},
    "topk3nag": {"topk_density": 0.03, "update_encoding": "int8"},
}
"""The ``topk`` arms: their name as an encoding, and what they change of ``run_config``.
``topk1`` / ``topk3``: deltas at 1% / 3% density, 2 bits, chunks of 4096, updates ``topk``,
plain averaging at outer lr 2 (no momentum: the error feedback in its place, as SparseLoCo;
the best outer step measured, docs/protocol.md); ``…lrX`` the same at outer lr X; ``…nag``
the same deltas under the default Nesterov step, whose dense update travels as int8."""


def run_config(sync_every: int, encoding: str) -> Any:
    """The arms' config: ``encoding`` for deltas and updates, or a ``SPARSE`` arm's."""
    from gradientmail.protocol.records import RunConfig

    sparse = SPARSE.get(encoding)
    config = RunConfig(
        fragments=FRAGMENTS,
        sync_every=sync_every,
        delta_encoding="topk" if sparse else encoding,  # type: ignore[arg-type]
        update_encoding="topk" if sparse else encoding,  # type: ignore[arg-type]
        grace=3.0,
    )
    return msgspec.structs.replace(config, **sparse) if sparse else config


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 10 ms; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout} s")
        time.sleep(0.01)


@dataclass
class Learning:
    """What one learner process trains, whatever the benchmark.

    ``train(first, after_step)`` runs the learner's steps ``first .. steps - 1`` (``first`` >
    0 in a learner restarted after a kill), calling ``after_step()`` after each, and returns
    its evaluation curve as ``[step, loss]`` pairs; ``final()`` evaluates the model at the
    end; ``tokens_per_step`` is what each step reports to the node; ``optimizer``, when not
    None, is the inner optimizer ``train`` steps (for a peer system that hooks it).
    """

    model: Any
    tokens_per_step: int
    train: Callable[[int, Callable[[], None]], list[list[float]]]
    final: Callable[[], float]
    optimizer: Any = None


class Progress:
    """A learner's completed steps, in memory (with the ``time.monotonic()`` of each, one clock
    for every process of the machine) and in the
    file ``progress-{index}`` of the scratch directory, which the runner watches to kill a
    learner at a given step and a restarted learner reads to resume there."""

    def __init__(self, scratch: Path, index: int) -> None:
        self._path = scratch / f"progress-{index}"
        self.first = int(self._path.read_text()) if self._path.exists() else 0
        self.done = self.first
        self.times: list[float] = []

    def step(self) -> None:
        self.done += 1
        self.times.append(time.monotonic())
        self._path.write_text(str(self.done))

    def report(
        self, index: int, steps: int, curve: list[list[float]], final: float, trained: float
    ) -> dict[str, Any]:
        """The fields every learner's report starts with, whatever the system."""
        return {
            "index": index,
            "curve": [*curve, [float(steps), final]],
            "final_loss": final,
            "first_step": self.first,
            "step_times": self.times,
            "train_seconds": trained,
        }


def learner_worker(spec: dict[str, Any], index: int, learning: Learning) -> dict[str, Any]:
    """One gradientmail learner on the run in ``spec["scratch"]/store``, configured by
    ``spec["config"]`` (``RunConfig`` fields): joins, waits for the first ``spec["learners"]``
    to have joined (not when restarted), trains, leaves; returns its report."""
    import anyio

    from gradientmail._node import node as join_run
    from gradientmail.events import Event, FragmentAligned, SnapshotPublished, kind_name
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.protocol.records import RunConfig

    scratch = Path(spec["scratch"])
    progress = Progress(scratch, index)
    counts: dict[str, int] = {}
    tally = h.Tally()
    learner = f"learner-{index}"

    lags: list[int] = []
    deltas: list[int] = []

    def count(event: Event) -> None:
        name = kind_name(event)
        counts[name] = counts.get(name, 0) + 1
        if isinstance(event, FragmentAligned) and event.lag_steps is not None:
            lags.append(event.lag_steps)
        if isinstance(event, SnapshotPublished):
            deltas.append(event.size)

    async def main() -> dict[str, Any]:
        async with (
            LocalMailbox(scratch / "store") as local,
            join_run(
                learning.model,
                h.CountingMailbox(local, tally, learner),
                learner=learner,
                config=RunConfig(**spec["config"]),
                options=_options(syncer=False, spec=spec),
                sinks=[count],
            ) as node,
        ):
            (scratch / f"ready-{index}").touch()
            await anyio.to_thread.run_sync(
                wait_for,
                lambda: all((scratch / f"ready-{k}").exists() for k in range(spec["learners"])),
                120.0,
                "every learner to join",
            )
            start = node.state
            kinds_at_start = dict(tally.bytes_by_kind.get(learner, {}))
            started = time.perf_counter()

            def loop(handle: Any) -> list[list[float]]:
                def after_step() -> None:
                    handle.step(learning.tokens_per_step)
                    progress.step()

                return learning.train(progress.first, after_step)

            curve = await node.run_in_thread(loop)
            trained = time.perf_counter() - started
            trained_state = node.state
        end = node.state
        final = learning.final()
        return progress.report(index, spec["steps"], curve, final, trained) | {
            "seconds_with_flush": time.perf_counter() - started,
            "bytes_up": end.bytes_published - start.bytes_published,
            "bytes_down": end.bytes_downloaded - start.bytes_downloaded,
            "bytes_up_total": end.bytes_published,
            "bytes_down_total": end.bytes_downloaded,
            "bytes_closing": end.bytes_published
            + end.bytes_downloaded
            - trained_state.bytes_published
            - trained_state.bytes_downloaded,
            "requests": {op: n - start.requests.get(op, 0) for op, n in end.requests.items()},
            "bytes_by_kind": {
                kind: n - kinds_at_start.get(kind, 0)
                for kind, n in tally.bytes_by_kind.get(learner, {}).items()
            },
            "versions": list(end.versions),
            "aligned_round": end.aligned_round,
            "events": counts,
            "lag_steps": lags,
            "waited_seconds": end.waited_seconds,
            "delta_bytes": deltas,
        }

    return anyio.run(main)


def syncer_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """A dedicated syncer on the run in ``spec["scratch"]/store`` until its standard input
    closes (``launch``); returns its report (bytes, requests, every round it committed)."""
    import anyio

    from gradientmail._node import node as join_run
    from gradientmail.events import Event, RoundCommitted, kind_name
    from gradientmail.mailbox import LocalMailbox

    scratch = Path(spec["scratch"])
    counts: dict[str, int] = {}
    rounds: list[dict[str, Any]] = []

    def sink(event: Event) -> None:
        name = kind_name(event)
        counts[name] = counts.get(name, 0) + 1
        if isinstance(event, RoundCommitted):
            record = event.record
            rounds.append(
                {
                    "round": record.round,
                    "participants": len(record.participants),
                    "rejected": [r.reason for r in record.rejected],
                    "cosine": record.cosine,
                    "steps": {p.learner: p.steps for p in record.participants},
                    "seconds": event.seconds,
                    "update_bytes": record.update.size,
                }
            )

    tally = h.Tally()

    async def main() -> dict[str, Any]:
        async with (
            LocalMailbox(scratch / "store") as mailbox,
            join_run(
                None,
                h.CountingMailbox(mailbox, tally, "syncer"),
                learner="syncer",
                options=_options(syncer=True, spec=spec),
                sinks=[sink],
            ) as node,
        ):
            # The runner closes this process's stdin to stop it: a read that returns at EOF
            # costs no CPU while the learners train (a file polled every 10 ms cost this
            # process a quarter of its steady CPU, counted against gradientmail).
            await anyio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
        state = node.state
        return {
            "bytes_up": state.bytes_published,
            "bytes_down": state.bytes_downloaded,
            "requests": dict(state.requests),
            "bytes_by_kind": dict(tally.bytes_by_kind.get("syncer", {})),
            "rounds": rounds,
            "events": counts,
        }

    return anyio.run(main)


def _synthetic_learning(spec: dict[str, Any], index: int) -> Learning:
    import torch

    from gradientmail.demo.data import evaluate, synthetic
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    seed, steps = spec["seed"], spec["steps"]
    corpus = synthetic(length=CONTEXT, seed=seed)
    evaluation = corpus.evaluation(batches=EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=CONTEXT)
    final_set = corpus.evaluation(
        batches=FINAL_EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=CONTEXT
    )
    model = GPT(model_config(), seed=seed)
    batches = corpus.train(index, batch_size=BATCH, length=CONTEXT)

    def run(first: int, after_step: Callable[[], None]) -> list[list[float]]:
        return train(
            model,
            batches,
            steps=steps,
            eval_every=spec["eval_every"],
            evaluation=evaluation,
            after_step=after_step,
            first=first,
        )

    return Learning(model, BATCH * CONTEXT, run, lambda: evaluate(model, final_set))


def _worker(spec_path: Path, role: str) -> None:
    spec = json.loads(spec_path.read_text())
    if role == "syncer":
        result = syncer_worker(spec)
    else:
        result = learner_worker(spec, int(role), _synthetic_learning(spec, int(role)))
    out = Path(spec["scratch"]) / f"result-{role}.json"
    out.write_text(json.dumps(result), encoding="utf-8")


# -- gradientmail: the runner -----------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """SIGKILL learner ``index`` once it has done ``at_step`` steps, and start it again
    ``restart_after`` seconds later (it resumes at the step its progress file names)."""

    index: int
    at_step: int
    restart_after: float


def launch(
    script: Path,
    spec: dict[str, Any],
    *,
    services: tuple[str, ...] = ("syncer",),
    kill: Kill | None = None,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Write ``spec`` to ``spec["scratch"]/spec.json`` and run ``spec["learners"]`` learner
    processes (roles ``0`` …) and the ``services`` (e.g. a dedicated syncer) as
    ``script --worker SPEC ROLE``; once every learner has exited, close the services'
    standard input (their signal to stop: ``syncer_worker``) and wait for them. With
    ``kill``, one learner is SIGKILLed and restarted as described. Returns every role's
    report (``result-{role}.json``), the wall time, and the ``time.monotonic()`` of the
    start and, for a kill, of the kill and the restart. ``RuntimeError`` with the end of
    its log for a process that fails. ``timeout`` (per process) only catches a hang: on a
    machine half as fast as the one the full sizes were measured on, a full real-text arm
    takes about 16 minutes."""
    scratch = Path(spec["scratch"])
    scratch.mkdir(parents=True)
    spec_path = scratch / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    logs: list[Any] = []

    def spawn(role: str, stdin: int | None = None) -> subprocess.Popen[bytes]:
        log = open(scratch / f"log-{role}.txt", "ab")  # noqa: SIM115 (closed in the finally below)
        logs.append(log)
        return subprocess.Popen(
            [sys.executable, str(script), "--worker", str(spec_path), role],
            env=env,
            stdin=stdin,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def failed(role: str) -> RuntimeError:
        log = (scratch / f"log-{role}.txt").read_text(errors="replace")
        return RuntimeError(f"{role} failed:\n{log[-4000:]}")

    started = time.perf_counter()
    events: dict[str, float] = {"started": time.monotonic()}
    storage = StoragePeak(scratch / "store")
    learners = {str(k): spawn(str(k)) for k in range(spec["learners"])}
    others = {role: spawn(role, subprocess.PIPE) for role in services}
    try:
        if kill is not None:
            victim, progress = str(kill.index), scratch / f"progress-{kill.index}"

            def reached() -> bool:
                if learners[victim].poll() is not None:
                    raise failed(victim)
                return progress.exists() and int(progress.read_text() or 0) >= kill.at_step

            wait_for(reached, timeout, f"learner {victim} to reach step {kill.at_step}")
            learners[victim].kill()
            learners[victim].wait()
            events["killed"] = time.monotonic()
            time.sleep(kill.restart_after)
            learners[victim] = spawn(victim)
            events["restarted"] = time.monotonic()
        for role, process in learners.items():
            if process.wait(timeout=timeout) != 0:
                raise failed(role)
        for process in others.values():
            assert process.stdin is not None
            process.stdin.close()
        for role, process in others.items():
            if process.wait(timeout=120) != 0:
                raise failed(role)
    finally:
        storage.stop()
        for process in (*learners.values(), *others.values()):
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - started
    reports = {
        role: json.loads((scratch / f"result-{role}.json").read_text())
        for role in (*learners, *others)
    }
    return {
        "reports": reports,
        "wall_seconds": wall,
        "events": events,
        "peak_store_bytes": storage.peak,
    }


class StoragePeak:
    """The largest total size of the files under ``root`` (the run's ``LocalMailbox``
    directory) seen by a thread sampling it every 0.1 s until ``stop``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        total = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    continue
        return total

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.peak = max(self.peak, self._size())

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._size())


def run_gradientmail(
    seed: int,
    sync_every: int,
    encoding: str,
    settings: dict[str, Any],
    scratch: Path,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One gradientmail run: ``K`` learner processes and one syncer process; gathers their
    reports into the arm's figures. ``overrides`` replace fields of ``run_config``'s."""
    config = msgspec.structs.replace(run_config(sync_every, encoding), **(overrides or {}))
    spec = {
        "seed": seed,
        "steps": settings["steps"],
        "eval_every": settings["eval_every"],
        "learners": K,
        "config": msgspec.structs.asdict(config),
        "scratch": str(scratch),
    }
    launched = launch(Path(__file__).resolve(), spec)
    reports = [launched["reports"][str(k)] for k in range(K)]
    syncer_report = launched["reports"]["syncer"]
    wall = launched["wall_seconds"]
    from gradientmail.demo.data import synthetic

    floor = synthetic(length=CONTEXT, seed=seed).floor
    assert floor is not None
    finals = [r["final_loss"] for r in reports]
    final = sum(finals) / K
    per_learner = [r["bytes_up"] + r["bytes_down"] for r in reports]
    rounds = syncer_report["rounds"]
    return {
        "final_loss": final,
        "final_loss_spread_over_learners": max(finals) - min(finals),
        "excess": final - floor,
        "floor": floor,
        "curve": _mean_curve([r["curve"] for r in reports]),
        "tokens_per_step": K * BATCH * CONTEXT,
        "bytes_per_learner": sum(per_learner) / K,
        "bytes_up_per_learner": sum(r["bytes_up"] for r in reports) / K,
        "bytes_down_per_learner": sum(r["bytes_down"] for r in reports) / K,
        "bytes_by_kind_per_learner": {
            kind: sum(r["bytes_by_kind"].get(kind, 0) for r in reports) / K
            for kind in sorted({kind for r in reports for kind in r["bytes_by_kind"]})
        },
        "syncer_bytes": syncer_report["bytes_up"] + syncer_report["bytes_down"],
        "rounds_committed": len(rounds),
        "mean_participants": sum(r["participants"] for r in rounds) / len(rounds)
        if rounds
        else 0.0,
        "rejected": sum(len(r["rejected"]) for r in rounds),
        "peak_store_bytes": launched["peak_store_bytes"],
        "mean_delta_bytes": _mean([size for r in reports for size in r["delta_bytes"]]),
        "mean_update_bytes": _mean([r["update_bytes"] for r in rounds]),
        "wall_seconds": wall,
        "train_seconds": sum(r["train_seconds"] for r in reports) / K,
        "learners": reports,
        "syncer": {k: v for k, v in syncer_report.items() if k != "rounds"} | {"rounds": rounds},
    }


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _mean_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    length = min(len(c) for c in curves)
    return [[curves[0][i][0], sum(c[i][1] for c in curves) / len(curves)] for i in range(length)]


def _aggregate(per_seed: dict[str, dict[int, dict[str, Any]]], params: int) -> dict[str, Any]:
    """Per arm: final loss, excess, bytes and the ratios against ``dp`` of the same seed,
    summarized over seeds."""
    dp = per_seed["dp"]
    summaries: dict[str, Any] = {}
    for arm, seeds in per_seed.items():
        entry: dict[str, Any] = {
            "final_loss": h.summary([r["final_loss"] for r in seeds.values()]),
            "excess": h.summary([r["excess"] for r in seeds.values()]),
        }
        excess_ratios = [r["excess"] / dp[s]["excess"] for s, r in seeds.items()]
        gaps = [
            100 * (r["final_loss"] - dp[s]["final_loss"]) / dp[s]["final_loss"]
            for s, r in seeds.items()
        ]
        entry["excess_ratio_vs_dp"] = h.summary(excess_ratios)
        entry["relative_gap_percent_vs_dp"] = h.summary(gaps)
        if arm.startswith("gm-"):
            bytes_ = [r["bytes_per_learner"] for r in seeds.values()]
            entry["bytes_per_learner"] = h.summary(bytes_)
            entry["bytes_ratio_dp_over_gm"] = h.summary(
                [
                    dp[s]["bytes_per_learner_computed"] / r["bytes_per_learner"]
                    for s, r in seeds.items()
                ]
            )
            entry["bytes_ratio_with_syncer_share"] = h.summary(
                [
                    dp[s]["bytes_per_learner_computed"]
                    / (r["bytes_per_learner"] + r["syncer_bytes"] / K)
                    for s, r in seeds.items()
                ]
            )
            entry["mean_participants"] = h.summary([r["mean_participants"] for r in seeds.values()])
            entry["rounds_committed"] = h.summary(
                [float(r["rounds_committed"]) for r in seeds.values()]
            )
        elif arm == "dp":
            entry["bytes_per_learner"] = h.summary(
                [r["bytes_per_learner_computed"] for r in seeds.values()]
            )
        summaries[arm] = entry
    return summaries


def _targets(summaries: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for target in TARGETS:
        arm = summaries.get(target["arm"])
        if arm is None:
            checks.append(target | {"measured": False})
            continue
        excess = arm["excess_ratio_vs_dp"]["median"]
        bytes_ = arm["bytes_ratio_dp_over_gm"]["median"]
        checks.append(
            target
            | {
                "measured": True,
                "excess_ratio": excess,
                "bytes_ratio": bytes_,
                "excess_met": excess <= target["excess_ratio_max"],
                "bytes_met": bytes_ >= target["bytes_ratio_min"],
            }
        )
    return checks


def run(
    results: Path,
    quick: bool,
    log: Callable[[str], None] = print,
    *,
    sparse: list[str] | None = None,
) -> Path:
    """Every arm for every seed; writes ``results/convergence.json`` and returns its path.
    With ``sparse``, those encodings (``SPARSE`` arms among them) instead of the plan's,
    into ``convergence-sparse.json``."""
    settings = plan(quick)
    if sparse:
        settings["encodings"] = sparse
    from gradientmail.demo.model import GPT

    params = GPT(model_config()).num_parameters()
    parameters = settings | {
        "learners": K,
        "fragments": FRAGMENTS,
        "batch_per_learner": BATCH,
        "context": CONTEXT,
        "lr": LR,
        "model": "GPTConfig.tiny (d_model 32, 2 layers, 2 heads)",
        "params": params,
        "eval_sequences": EVAL_BATCHES * EVAL_BATCH_SIZE,
        "final_eval_sequences": FINAL_EVAL_BATCHES * EVAL_BATCH_SIZE,
    }
    result = h.header(f"{NAME}-sparse" if sparse else NAME, quick=quick, parameters=parameters)
    per_seed: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="gm-bench-convergence-") as scratch:
        for seed in settings["seeds"]:
            for arm in ("dp", "single"):
                per_seed.setdefault(arm, {})[seed] = run_local(arm, seed, settings)
                log(f"  {arm} seed {seed}: loss {per_seed[arm][seed]['final_loss']:.4f}")
            for encoding in settings["encodings"]:
                for sync_every in settings["sync_every"]:
                    arm = f"gm-{encoding}-H{sync_every}"
                    if seed != settings["seeds"][0] and arm not in settings["repeated"]:
                        continue
                    report = run_gradientmail(
                        seed, sync_every, encoding, settings, Path(scratch) / f"{arm}-s{seed}"
                    )
                    per_seed.setdefault(arm, {})[seed] = report
                    dp_bytes = per_seed["dp"][seed]["bytes_per_learner_computed"]
                    log(
                        f"  {arm} seed {seed}: loss {report['final_loss']:.4f}, "
                        f"{report['bytes_per_learner'] / 1e6:.2f} MB/learner "
                        f"({dp_bytes / report['bytes_per_learner']:.0f}x less than dp), "
                        f"{report['rounds_committed']} rounds, {report['wall_seconds']:.0f} s"
                    )
    summaries = _aggregate(per_seed, params)
    result["figures"] = {
        "arms": summaries,
        "per_seed": {arm: {str(s): r for s, r in seeds.items()} for arm, seeds in per_seed.items()},
        "targets": _targets(summaries),
        "published_gap_percent": PUBLISHED_GAP_PERCENT,
    }
    return h.write_result(results, f"{NAME}-sparse" if sparse else NAME, result)


# -- bytes over a long run ---------------------------------------------------------------

LONG_ARM = ("int8", 50)
"""The headline setting whose bytes ``--long`` measures (issue 15: ≥ 75× with the syncer's
share at int8, H = 50, K = 4)."""


def long_bytes(
    results: Path, steps: int, every: list[int], log: Callable[[str], None] = print
) -> Path:
    """``LONG_ARM`` for ``steps`` steps on seed 0, once per ``checkpoint_every`` in ``every``:
    data-parallel's bytes ÷ a learner's, alone and with the syncer's traffic shared among the
    ``K`` learners, and how much of a learner's bytes its closing flush took; writes
    ``results/convergence-bytes.json``. Data-parallel's bytes are computed (ring all-reduce of
    fp32 gradients), not trained."""
    from gradientmail.demo.model import GPT
    from gradientmail.protocol.records import RunConfig

    params = GPT(model_config()).num_parameters()
    dp_bytes = 2 * (K - 1) / K * 4 * params * steps
    settings = plan(False) | {"steps": steps, "eval_every": steps}
    encoding, sync_every = LONG_ARM
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gm-bench-bytes-") as scratch:
        for n in every:
            report = run_gradientmail(
                0, sync_every, encoding, settings, Path(scratch) / f"every{n}",
                {"checkpoint_every": n},
            )  # fmt: skip
            syncer = report["syncer"]
            closing = sum(r["bytes_closing"] for r in report["learners"]) / K
            runs[str(n)] = {
                "final_loss": report["final_loss"],
                "rounds_committed": report["rounds_committed"],
                "wall_seconds": report["wall_seconds"],
                "bytes_per_learner": report["bytes_per_learner"],
                "bytes_by_kind_per_learner": report["bytes_by_kind_per_learner"],
                "closing_bytes_per_learner": closing,
                "syncer_by_kind": syncer["bytes_by_kind"],
                "syncer_requests": syncer["requests"],
                "syncer_up": syncer["bytes_up"],
                "syncer_down": syncer["bytes_down"],
                "ratio_per_learner": dp_bytes / report["bytes_per_learner"],
                "ratio_with_syncer_share": dp_bytes
                / (report["bytes_per_learner"] + report["syncer_bytes"] / K),
            }
            log(
                f"  checkpoint_every {n}: {runs[str(n)]['ratio_per_learner']:.0f}x per learner, "
                f"{runs[str(n)]['ratio_with_syncer_share']:.0f}x with the syncer's share, "
                f"{report['rounds_committed']} rounds, {report['wall_seconds']:.0f} s"
            )
    parameters = {
        "steps": steps, "encoding": encoding, "sync_every": sync_every, "learners": K,
        "fragments": FRAGMENTS, "params": params, "checkpoint_every": every, "seed": 0,
        "default_checkpoint_every": RunConfig().checkpoint_every,
    }  # fmt: skip
    result = h.header(f"{NAME}-bytes", quick=False, parameters=parameters)
    result["figures"] = {"dp_bytes_per_learner": dp_bytes, "runs": runs}
    return h.write_result(results, f"{NAME}-bytes", result)


# -- the defaults grid ------------------------------------------------------------------

GRID: dict[str, list[Any]] = {
    "outer_lr": [0.4, 0.7, 1.0],
    "outer_momentum": [0.0, 0.6, 0.9],
    "sync_every": [25, 50, 100],
    "quorum": ["0.5:3", "1.0:3"],
    "pattern": ["contiguous"],
}
"""The grid's default axes; ``quorum`` values are ``quorum_fraction:grace``."""
_POINT_KEY = ("outer_lr", "outer_momentum", "sync_every", "quorum_fraction", "grace", "pattern")


def _grid_axes(points: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The values each setting takes over ``points``, sorted."""
    return {key: sorted({point[key] for point in points}) for key in _POINT_KEY}


def grid(
    results: Path,
    quick: bool,
    axes: dict[str, list[Any]],
    encoding: str,
    merge: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Every point of ``axes`` (``GRID``'s keys) as one gradientmail run on seed 0, against
    data-parallel and a single learner of the same seed; writes
    ``results/convergence-grid.json`` (points ordered by excess ÷ data-parallel's) after
    every point, so that an interrupted grid keeps what it measured. With ``merge``, the
    points already in that file stay, except those measured again (same settings)."""
    settings = plan(quick)
    path = results / f"{NAME}-grid.json"
    kept = json.loads(path.read_text())["figures"]["points"] if merge and path.exists() else []
    points = {tuple(point[key] for key in _POINT_KEY): point for point in kept}
    references = {arm: run_local(arm, 0, settings) for arm in ("dp", "single")}
    dp = references["dp"]
    log(f"  dp: excess {dp['excess']:.4f}; single: {references['single']['excess']:.4f}")
    combos = itertools.product(
        axes["outer_lr"],
        axes["outer_momentum"],
        axes["sync_every"],
        axes["quorum"],
        axes["pattern"],
    )
    with tempfile.TemporaryDirectory(prefix="gm-bench-grid-") as scratch:
        for n, (lr, momentum, sync_every, quorum, pattern) in enumerate(combos):
            fraction, grace = (float(x) for x in str(quorum).split(":"))
            overrides = {
                "outer_lr": float(lr),
                "outer_momentum": float(momentum),
                "quorum_fraction": fraction,
                "grace": grace,
                "pattern": str(pattern),
            }
            report = run_gradientmail(
                0, int(sync_every), encoding, settings, Path(scratch) / str(n), overrides
            )
            point = overrides | {
                "sync_every": int(sync_every),
                "final_loss": report["final_loss"],
                "excess": report["excess"],
                "excess_ratio_vs_dp": report["excess"] / dp["excess"],
                "excess_ratio_vs_single": report["excess"] / references["single"]["excess"],
                "rounds_committed": report["rounds_committed"],
                "mean_participants": report["mean_participants"],
                "wall_seconds": report["wall_seconds"],
            }
            points[tuple(point[key] for key in _POINT_KEY)] = point
            log(
                "  "
                + " ".join(f"{k}={v}" for k, v in overrides.items())
                + f" H={sync_every}: excess ÷ dp {point['excess_ratio_vs_dp']:.3f}"
                + f" ({report['wall_seconds']:.0f} s)"
            )
            ordered = sorted(points.values(), key=lambda point: point["excess_ratio_vs_dp"])
            parameters = {
                "steps": settings["steps"],
                "seed": 0,
                "encoding": encoding,
                "learners": K,
                "fragments": FRAGMENTS,
                "axes": _grid_axes(ordered),
            }
            result = h.header(f"{NAME}-grid", quick=quick, parameters=parameters)
            result["figures"] = {
                "references": {
                    arm: {"final_loss": r["final_loss"], "excess": r["excess"]}
                    for arm, r in references.items()
                },
                "points": ordered,
            }
            h.write_result(results, f"{NAME}-grid", result)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short seed, one config")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--grid", action="store_true", help="the defaults grid instead of the arms (see GRID)"
    )
    parser.add_argument(
        "--sparse",
        nargs="*",
        metavar="ENCODING",
        help="these encodings (default int8 and every SPARSE arm) into convergence-sparse.json",
    )
    parser.add_argument("--outer-lr", nargs="+", type=float, default=GRID["outer_lr"])
    parser.add_argument("--outer-momentum", nargs="+", type=float, default=GRID["outer_momentum"])
    parser.add_argument("--sync-every", nargs="+", type=int, default=GRID["sync_every"])
    parser.add_argument("--quorum", nargs="+", default=GRID["quorum"], help="FRACTION:GRACE pairs")
    parser.add_argument("--pattern", nargs="+", default=GRID["pattern"], help="fragment patterns")
    parser.add_argument("--encoding", default="fp32", help="the grid's delta/update encoding")
    parser.add_argument(
        "--merge", action="store_true", help="keep the grid file's other points (see grid)"
    )
    parser.add_argument(
        "--long", type=int, metavar="STEPS", help="only the bytes of LONG_ARM over STEPS steps"
    )
    parser.add_argument(
        "--checkpoint-every", nargs="+", type=int, default=[1, 8], help="--long's values"
    )
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    if args.long:
        print(f"wrote {long_bytes(args.results, args.long, args.checkpoint_every)}")
        return
    if args.grid:
        axes = {
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "sync_every": args.sync_every,
            "quorum": args.quorum,
            "pattern": args.pattern,
        }
        print(f"wrote {grid(args.results, args.quick, axes, args.encoding, args.merge)}")
        return
    sparse = None if args.sparse is None else (args.sparse or ["int8", *SPARSE])
    path = run(args.results, args.quick, sparse=sparse)
    summaries = json.loads(path.read_text())["figures"]["arms"]
    for arm, entry in summaries.items():
        line = f"{arm:16} excess {entry['excess']['median']:.4f}"
        line += f"  ratio vs dp {entry['excess_ratio_vs_dp']['median']:.3f}"
        if "bytes_ratio_dp_over_gm" in entry:
            line += f"  bytes ratio {entry['bytes_ratio_dp_over_gm']['median']:.0f}x"
        print(line)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
