"""A gradientmail learner and a dedicated syncer, each in a worker process of ``_launch``.

Shared by the convergence, real-text, fleet and insider benchmarks: the benchmark says what
a learner trains (``Learning``); ``learner_worker`` joins the run on the scratch directory's
``LocalMailbox``, trains and reports its bytes, requests, events and lags; ``syncer_worker``
commits rounds until its standard input closes. A learner whose index is the spec's
``syncer_in`` runs that syncer node beside its own, in its process, until its standard input
closes, and reports it under ``"syncer"`` (``_launch.launch``). ``Progress`` is the step
count the runner watches to kill a learner and a restarted learner resumes from.
"""

import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import _harness as h
from _launch import wait_for

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


class _LearnerEvents:
    """A learner's sink: how many events of each kind, the lag of every ``FragmentAligned``
    that has one and the size of every ``SnapshotPublished``; called on the node's tasks."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lags: list[int] = []
        self.deltas: list[int] = []

    def __call__(self, event: Any) -> None:
        from gradientmail.events import FragmentAligned, SnapshotPublished, kind_name

        name = kind_name(event)
        self.counts[name] = self.counts.get(name, 0) + 1
        if isinstance(event, FragmentAligned) and event.lag_steps is not None:
            self.lags.append(event.lag_steps)
        if isinstance(event, SnapshotPublished):
            self.deltas.append(event.size)


def _traffic(start: Any, trained: Any, end: Any) -> dict[str, Any]:
    """A learner's bytes and requests from the node states at the start of training, at its
    end and after the closing flush."""
    return {
        "bytes_up": end.bytes_published - start.bytes_published,
        "bytes_down": end.bytes_downloaded - start.bytes_downloaded,
        "bytes_up_total": end.bytes_published,
        "bytes_down_total": end.bytes_downloaded,
        "bytes_closing": end.bytes_published
        + end.bytes_downloaded
        - trained.bytes_published
        - trained.bytes_downloaded,
        "requests": {op: n - start.requests.get(op, 0) for op, n in end.requests.items()},
    }


async def _every_learner_ready(scratch: Path, index: int, learners: int) -> None:
    """Say learner ``index`` is ready and wait (on a worker thread) for the first
    ``learners`` to say so."""
    import anyio

    (scratch / f"ready-{index}").touch()
    await anyio.to_thread.run_sync(
        wait_for,
        lambda: all((scratch / f"ready-{k}").exists() for k in range(learners)),
        120.0,
        "every learner to join",
    )


def _training_loop(learning: Learning, progress: Progress) -> Callable[[Any], list[list[float]]]:
    """What a learner's node runs on its training thread: ``learning``'s steps from
    ``progress.first``, each reported to the node's step handle and to ``progress``."""

    def loop(handle: Any) -> list[list[float]]:
        def after_step() -> None:
            handle.step(learning.tokens_per_step)
            progress.step()

        return learning.train(progress.first, after_step)

    return loop


def learner_worker(spec: dict[str, Any], index: int, learning: Learning) -> dict[str, Any]:
    """One gradientmail learner on the run in ``spec["scratch"]/store``, configured by
    ``spec["config"]`` (``RunConfig`` fields): joins, waits for the first ``spec["learners"]``
    to have joined (not when restarted), trains, leaves; returns its report. The learner
    ``spec["syncer_in"]`` also runs the run's syncer node, in a task of its own, until its
    standard input closes (after it left), and reports it under ``"syncer"``."""
    import anyio

    async def main() -> dict[str, Any]:
        if spec.get("syncer_in") != index:
            return await _learner(spec, index, learning)
        stop = anyio.Event()
        hosted: dict[str, Any] = {}

        async def serve() -> None:
            hosted.update(await _syncer(spec, None, stop.wait))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(serve)
            report = await _learner(spec, index, learning)
            await _stdin_closed()
            stop.set()
        return report | {"syncer": hosted}

    return anyio.run(main)


async def _learner(spec: dict[str, Any], index: int, learning: Learning) -> dict[str, Any]:
    """``learner_worker``'s learner; its final evaluation on a worker thread, so that a
    syncer beside it in this process goes on closing the others' rounds."""
    import anyio

    from gradientmail._node import node as join_run
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.protocol.records import RunConfig

    scratch = Path(spec["scratch"])
    progress = Progress(scratch, index)
    events = _LearnerEvents()
    tally = h.Tally()
    learner = f"learner-{index}"
    loop = _training_loop(learning, progress)
    async with (
        LocalMailbox(scratch / "store") as local,
        join_run(
            learning.model,
            h.CountingMailbox(local, tally, learner),
            learner=learner,
            config=RunConfig(**spec["config"]),
            options=_options(syncer=False, spec=spec),
            sinks=[events],
        ) as node,
    ):
        await _every_learner_ready(scratch, index, spec["learners"])
        start = node.state
        kinds_at_start = dict(tally.bytes_by_kind.get(learner, {}))
        started = time.perf_counter()
        curve = await node.run_in_thread(loop)
        trained = time.perf_counter() - started
        trained_state = node.state
    end = node.state
    final = await anyio.to_thread.run_sync(learning.final)
    return (
        progress.report(index, spec["steps"], curve, final, trained)
        | {"seconds_with_flush": time.perf_counter() - started}
        | _traffic(start, trained_state, end)
        | {
            "bytes_by_kind": {
                kind: n - kinds_at_start.get(kind, 0)
                for kind, n in tally.bytes_by_kind.get(learner, {}).items()
            },
            "versions": list(end.versions),
            "aligned_round": end.aligned_round,
            "events": events.counts,
            "lag_steps": events.lags,
            "waited_seconds": end.waited_seconds,
            "delta_bytes": events.deltas,
        }
    )


def _round_report(event: Any) -> dict[str, Any]:
    """What a syncer's report keeps of one ``RoundCommitted``."""
    record = event.record
    return {
        "round": record.round,
        "participants": len(record.participants),
        "rejected": [r.reason for r in record.rejected],
        "rejected_by": [[r.learner, r.reason] for r in record.rejected],
        "cosine": record.cosine,
        "steps": {p.learner: p.steps for p in record.participants},
        "closing": sum(p.closing is True for p in record.participants),
        "seconds": event.seconds,
        "update_bytes": record.update.size,
    }


def syncer_worker(spec: dict[str, Any], trusted_loss: Any = None) -> dict[str, Any]:
    """A dedicated syncer on the run in ``spec["scratch"]/store`` until its standard input
    closes (``_launch.launch``), screening rounds with ``trusted_loss`` when given
    (``NodeOptions.trusted_loss``); returns its report (bytes, requests, every round it
    committed)."""
    import anyio

    return anyio.run(_syncer, spec, trusted_loss, _stdin_closed)


async def _stdin_closed() -> None:
    """Until this process's standard input closes: the runner's signal to stop. A read that
    returns at EOF costs no CPU while the learners train (a file polled every 10 ms cost a
    syncer process a quarter of its steady CPU, counted against gradientmail)."""
    import anyio

    await anyio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)


async def _syncer(
    spec: dict[str, Any], trusted_loss: Any, until: Callable[[], Awaitable[object]]
) -> dict[str, Any]:
    """A syncer node on the run in ``spec["scratch"]/store`` until ``until()`` returns; its
    report."""
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
            rounds.append(_round_report(event))

    tally = h.Tally()
    async with (
        LocalMailbox(scratch / "store") as mailbox,
        join_run(
            None,
            h.CountingMailbox(mailbox, tally, "syncer"),
            learner="syncer",
            options=replace(_options(syncer=True, spec=spec), trusted_loss=trusted_loss),
            sinks=[sink],
        ) as node,
    ):
        await until()
    state = node.state
    return {
        "bytes_up": state.bytes_published,
        "bytes_down": state.bytes_downloaded,
        "requests": dict(state.requests),
        "bytes_by_kind": dict(tally.bytes_by_kind.get("syncer", {})),
        "rounds": rounds,
        "events": counts,
    }
