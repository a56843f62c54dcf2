"""One learner process of the demo: ``python -m gradientmail.demo.worker WORKDIR INDEX``.

Reads the session's settings from ``WORKDIR/session.json``, joins (or creates) the run in
the settings' store as ``learner-INDEX`` with a syncer, and trains the demo's transformer on
its own shard: each optimizer step runs in a worker thread (``anyio.to_thread``) so the
node's tasks keep moving bytes meanwhile, and ``node.step`` follows it on the event loop.
Events go to ``WORKDIR/events/learner-INDEX.jsonl``; progress to
``WORKDIR/progress/learner-INDEX.json`` about twice a second and at every change of phase.

After its steps it leaves the node's block normally (publishing what is left and waiting
for those rounds, ``close_timeout``). SIGINT or SIGTERM cancels training or closing: the
node closes without flush and releases its lease, and the process exits 0 with the phase
``interrupted``. Exit status 1: the run did not accept this learner (``RunMismatch``) or
the node failed; the progress file's ``error`` says why.
"""

import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec
import torch
from torch import Tensor

from gradientmail._node import Node, node
from gradientmail.demo.model import GPT
from gradientmail.demo.settings import (
    DemoSettings,
    Phase,
    Progress,
    corpus,
    events_path,
    learner_name,
    model_config,
    node_options,
    run_config,
    session_path,
    write_progress,
)
from gradientmail.errors import GradientmailError, RunMismatch
from gradientmail.events import json_logs

__all__ = ["main", "train"]

_REPORT_EVERY = 0.5
_LOSS_SMOOTHING = 0.1


def _optimizer_step(
    model: GPT, optimizer: torch.optim.Optimizer, batches: Iterator[Tensor]
) -> float:
    loss = model.loss(next(batches))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.detach())


class _Reporter:
    """The learner's progress as last reported; ``report`` writes it in a worker thread."""

    def __init__(self, settings: DemoSettings, learner: str) -> None:
        self.settings = settings
        self.progress = Progress(
            learner=learner,
            pid=os.getpid(),
            session=settings.session,
            phase="starting",
            steps=settings.steps,
        )
        self.last = 0.0

    async def report(self, *, force: bool = False, **changes: object) -> None:
        self.progress = msgspec.structs.replace(self.progress, **changes)
        now = time.monotonic()
        if force or now - self.last >= _REPORT_EVERY:
            self.last = now
            await anyio.to_thread.run_sync(write_progress, self.settings.workdir, self.progress)


async def _steps(
    settings: DemoSettings,
    model: GPT,
    live: Node,
    batches: Iterator[Tensor],
    reporter: _Reporter,
) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    tokens_per_step = settings.batch_size * settings.context
    started = time.monotonic()
    smoothed: float | None = None
    await reporter.report(force=True, phase="training")
    for step in range(1, settings.steps + 1):
        loss = await anyio.to_thread.run_sync(_optimizer_step, model, optimizer, batches)
        await live.step(tokens=tokens_per_step)
        smoothed = loss if smoothed is None else smoothed + _LOSS_SMOOTHING * (loss - smoothed)
        elapsed = max(time.monotonic() - started, 1e-9)
        await reporter.report(
            step=step,
            tokens=step * tokens_per_step,
            loss=smoothed,
            tokens_per_second=step * tokens_per_step / elapsed,
            state=asdict(live.state),
        )
    await reporter.report(force=True, phase="closing", state=asdict(live.state))


async def train(settings: DemoSettings, index: int) -> Phase:
    """Train learner ``index`` of the session; return ``done`` or ``interrupted``.

    Raises what joining or the node raises (``RunMismatch``, ``NodeFailed``, ...), after
    reporting the phase ``failed`` with the error.
    """
    learner = learner_name(index)
    reporter = _Reporter(settings, learner)
    data = corpus(settings)
    model = GPT(model_config(settings, data.vocab_size), seed=settings.seed)
    batches = data.train(
        index, batch_size=settings.batch_size, length=settings.context, stream=settings.session
    )
    member: Node | None = None
    interrupted = False
    try:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as group:

                async def stop_on_signal() -> None:
                    nonlocal interrupted
                    async for _ in signals:
                        interrupted = True
                        training.cancel()
                        return

                group.start_soon(stop_on_signal)
                with anyio.CancelScope() as training:
                    async with node(
                        model,
                        settings.store,
                        learner=learner,
                        config=run_config(settings),
                        options=node_options(),
                        sinks=[json_logs(events_path(settings.workdir, learner))],
                    ) as member:
                        await _steps(settings, model, member, batches, reporter)
                group.cancel_scope.cancel()
    except Exception as exc:
        error = _sole(exc)
        await reporter.report(
            force=True,
            phase="failed",
            error=f"{type(error).__name__}: {error}",
            state=None if member is None else asdict(member.state),
        )
        if error is exc:
            raise
        raise error from exc
    phase: Phase = "interrupted" if interrupted else "done"
    await reporter.report(
        force=True, phase=phase, state=None if member is None else asdict(member.state)
    )
    return phase


def _sole(error: Exception) -> Exception:
    """The one exception inside nested single-exception groups (task groups wrap)."""
    while isinstance(error, ExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def main(argv: list[str] | None = None) -> int:
    """Run one learner process; see the module docstring for the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m gradientmail.demo.worker WORKDIR INDEX", file=sys.stderr)
        return 2
    workdir, index = Path(args[0]), int(args[1])
    settings = msgspec.json.decode(session_path(workdir).read_bytes(), type=DemoSettings)
    torch.set_num_threads(1)
    try:
        anyio.run(train, settings, index, backend=settings.backend)
    except RunMismatch as exc:
        print(
            f"{learner_name(index)}: this does not match the run in the store: {exc}",
            file=sys.stderr,
        )
        return 1
    except GradientmailError as exc:
        print(f"{learner_name(index)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
