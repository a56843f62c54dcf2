"""``gradientmail demo``: start (or resume) a run of learner processes and watch it.

The runner writes the session's settings to the workdir, starts ``learners`` processes
(``python -m gradientmail.demo.worker WORKDIR INDEX``, each a node with a syncer), and then,
in one task group until they have all exited:

- every ``eval_every`` seconds reads the run from the store and, when a round has committed
  since, evaluates the newest committed model on the shared evaluation set (the first point
  is Θ⁰), appending to ``<workdir>/eval.jsonl``;
- twice a second folds the learners' progress files and new JSON event lines into the
  ``Board`` and redraws the live view (or prints a plain line every few seconds when stdout
  is not a terminal or ``--no-live`` is given).

At the end: a summary table, ``<workdir>/summary.json`` and ``<workdir>/eval-loss.png``.
SIGINT or SIGTERM (Ctrl-C) forwards SIGINT to every learner, waits up to ``_STOP_GRACE``
seconds for them to close (then kills what is left), and exits 130; the store then holds a
consistent run that ``status`` reads and a later ``demo --store`` resumes.

The workdir is the store's directory for a local store, else ``./gradientmail-demo``.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import torch
from rich.console import Console
from rich.live import Live

from gradientmail.demo.data import evaluate
from gradientmail.demo.model import GPT
from gradientmail.demo.settings import (
    EVAL_BATCH_SIZE,
    EVAL_BATCHES,
    DemoSettings,
    corpus,
    events_path,
    learner_name,
    log_path,
    model_config,
    read_progress,
    run_config,
    session_path,
)
from gradientmail.demo.view import Board, EvalPoint, line, plot, render_board, session_summary
from gradientmail.errors import NoRun, UsageError
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol.fragments import mismatch, signature
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import Observation, RunReader, Source, open_mailbox

__all__ = ["run_demo", "settings_from", "workdir_for"]

_STOP_GRACE = 10.0
_REFRESH = 0.5
_PLAIN_EVERY = 5.0


def workdir_for(store: str) -> Path:
    """The directory of a local store (a plain path or ``file://``), else the default."""
    from gradientmail.mailbox import open as open_url

    try:
        mailbox = open_url(store)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if isinstance(mailbox, LocalMailbox):
        return Path(mailbox.directory)
    return Path("gradientmail-demo")


def settings_from(args: argparse.Namespace) -> DemoSettings:
    """The session's settings from the ``demo`` command's arguments (``UsageError`` for a
    combination the run cannot take, a missing data file, or a bad store URL)."""
    if args.data is not None and not args.data.is_file():
        raise UsageError(f"--data {args.data}: no such file")
    workdir = workdir_for(args.store)
    previous = _previous_session(workdir)
    settings = DemoSettings(
        store=args.store,
        workdir=str(workdir),
        learners=args.learners,
        steps=args.steps,
        batch_size=args.batch_size,
        context=args.context,
        fragments=args.fragments,
        sync_every=args.sync_every,
        encoding=args.encoding,
        lr=args.lr,
        data=None if args.data is None else str(args.data.resolve()),
        model=args.model,
        seed=args.seed,
        backend=args.backend,
        eval_every=args.eval_every,
        live=not args.no_live,
        session=previous + 1,
    )
    try:
        run_config(settings)
    except ValueError as exc:
        raise UsageError(f"these settings cannot make a run: {exc}") from exc
    return settings


def _previous_session(workdir: Path) -> int:
    try:
        return msgspec.json.decode(session_path(workdir).read_bytes(), type=DemoSettings).session
    except (OSError, msgspec.DecodeError):
        return -1


def _history(workdir: Path) -> list[EvalPoint]:
    try:
        text = (workdir / "eval.jsonl").read_text()
    except OSError:
        return []
    points = []
    for raw in text.splitlines():
        try:
            points.append(EvalPoint(**json.loads(raw)))
        except (ValueError, TypeError):
            continue
    return points


def _tokens_in(observation: Observation, sources: Sequence[Source]) -> int:
    """The tokens of training a model assembled from ``sources`` holds: every local step
    reaches each fragment once, so the mean over fragments of the tokens of the rounds that
    built the fragment's version."""
    fragments = len(sources)
    total = 0
    for source in sources:
        if source.round is not None:
            total += sum(
                p.tokens
                for round, record in observation.records.items()
                if round <= source.round and round % fragments == source.fragment
                for p in record.participants
            )
    return total // fragments


class _Session:
    """The runner's state for one session; its methods are the tasks of ``_run``."""

    def __init__(self, settings: DemoSettings, console: Console) -> None:
        self.settings = settings
        self.workdir = Path(settings.workdir)
        self.console = console
        self.started = time.monotonic()
        try:
            data = corpus(settings)
            self.evaluation = data.evaluation(
                batches=EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=settings.context
            )
            for index in range(settings.learners):
                next(data.train(index, batch_size=1, length=settings.context))
        except ValueError as exc:
            raise UsageError(f"--data {settings.data}: {exc}") from exc
        self.model = GPT(model_config(settings, data.vocab_size), seed=settings.seed)
        self.board = Board(
            settings=settings,
            parameters=self.model.num_parameters(),
            floor=data.floor,
            unigram=data.unigram_entropy,
            description=data.description,
            history=tuple(_history(self.workdir)),
        )
        self.processes: list[anyio.abc.Process] = []
        self.offsets: dict[str, int] = {}
        self.interrupted = False
        self.evaluated_round: int | None = None
        self.rounds = 0

    # -- learners ---------------------------------------------------------------------------

    async def start_learners(self, logs: list[IO[bytes]]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        for index in range(self.settings.learners):
            log = log_path(self.workdir, learner_name(index)).open("ab")
            logs.append(log)
            process = await anyio.open_process(
                [sys.executable, "-m", "gradientmail.demo.worker", str(self.workdir), str(index)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            self.processes.append(process)

    async def wait_learners(self, group: anyio.abc.TaskGroup) -> None:
        for process in self.processes:
            await process.wait()
        group.cancel_scope.cancel()

    def _signal_learners(self, signum: signal.Signals) -> None:
        for process in self.processes:
            if process.returncode is None:
                try:
                    process.send_signal(signum)
                except ProcessLookupError:
                    continue

    async def stop_on_signal(self, signals: AsyncIterator[signal.Signals]) -> None:
        async for _ in signals:
            if not self.interrupted:
                self.interrupted = True
                self._signal_learners(signal.SIGINT)
                with anyio.move_on_after(_STOP_GRACE):
                    for process in self.processes:
                        await process.wait()
                self._signal_learners(signal.SIGKILL)

    # -- evaluation -------------------------------------------------------------------------

    def _evaluate(self, named: dict[str, torch.Tensor]) -> float:
        self.model.load_state_dict(named, strict=False)
        return evaluate(self.model, self.evaluation)

    async def evaluate_now(self, reader: RunReader) -> None:
        """Evaluate the newest committed model if a round committed since the last time
        (and Θ⁰ first, for a run without a history). ``NoRun`` while there is no run."""
        url = self.settings.store
        observation = await reader.observe(url)
        self.rounds = len(observation.records)
        manifest = observation.manifest
        if not self.board.history:
            initial = await reader.newest(manifest, initial=True)
            loss = await anyio.to_thread.run_sync(self._evaluate, initial.state_dict(manifest))
            self._add_point(EvalPoint(tokens=0, round=-1, loss=loss, seconds=self._elapsed()))
            self.evaluated_round = -1
        if max(observation.records, default=-1) in (-1, self.evaluated_round):
            return
        newest = await reader.newest(manifest)
        sources = newest.sources(manifest)
        loss = await anyio.to_thread.run_sync(self._evaluate, newest.state_dict(manifest))
        # The model may hold rounds newer than the observation: read those records too.
        observation = await reader.observe(url)
        self.rounds = len(observation.records)
        round = max(s.round for s in sources if s.round is not None)
        self._add_point(
            EvalPoint(
                tokens=_tokens_in(observation, sources),
                round=round,
                loss=loss,
                seconds=self._elapsed(),
            )
        )
        self.evaluated_round = round

    def _add_point(self, point: EvalPoint) -> None:
        with (self.workdir / "eval.jsonl").open("a") as file:
            file.write(json.dumps(dataclasses.asdict(point)) + "\n")
        self.board = dataclasses.replace(self.board, history=(*self.board.history, point))

    async def evaluate_loop(self, reader: RunReader) -> None:
        while True:
            with contextlib.suppress(NoRun):
                await self.evaluate_now(reader)
            await anyio.sleep(self.settings.eval_every)

    # -- the view ---------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def read_news(self) -> None:
        progress = dict(self.board.progress)
        board = self.board
        for index in range(self.settings.learners):
            name = learner_name(index)
            found = read_progress(self.workdir, name)
            if found is not None and found.session == self.settings.session:
                progress[name] = found
            board = self._read_events(board, name)
        self.board = dataclasses.replace(board, progress=progress, elapsed=self._elapsed())

    def _read_events(self, board: Board, name: str) -> Board:
        path = events_path(self.workdir, name)
        offset = self.offsets.get(name)
        try:
            with path.open("rb") as file:
                if offset is None:
                    # Events of earlier sessions are history; the board starts from now.
                    offset = file.seek(0, os.SEEK_END)
                file.seek(offset)
                chunk = file.read()
        except OSError:
            return board
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offsets[name] = offset + len(complete)
        for raw in complete.splitlines():
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict):
                board = board.with_event(event)
        return board

    async def refresh_loop(self, live: Live | None) -> None:
        printed = 0.0
        while True:
            await anyio.to_thread.run_sync(self.read_news)
            if live is not None:
                live.update(render_board(self.board), refresh=True)
            elif self._elapsed() - printed >= _PLAIN_EVERY:
                printed = self._elapsed()
                self.console.print(line(self.board), highlight=False, soft_wrap=True)
            await anyio.sleep(_REFRESH)


async def _check_run(session: "_Session", mailbox: Mailbox) -> None:
    """``UsageError`` when the store already holds a run these settings cannot join (another
    config or model), before any learner starts; nothing when it holds none."""
    settings = session.settings
    manifest = await RunReader.of(mailbox, RunKey.from_env()).store.manifest()
    if manifest is None:
        return
    advice = "resume it with the flags it was started with, or give another --store"
    ours = run_config(settings)
    for name in ours.__struct_fields__:
        theirs, mine = getattr(manifest.config, name), getattr(ours, name)
        if theirs != mine:
            raise UsageError(
                f"{settings.store} holds a run with {name}={theirs!r} but these settings give "
                f"{mine!r}; {advice}"
            )
    named = list(session.model.named_parameters())
    problem = mismatch(manifest.fragments, signature(named, ours.fragments, ours.pattern))
    if problem is not None:
        raise UsageError(
            f"{settings.store} holds a run of another model (--model, --context or --data "
            f"differ): {problem}; {advice}"
        )


def _prepare(settings: DemoSettings) -> None:
    workdir = Path(settings.workdir)
    for sub in ("events", "progress", "logs"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    for index in range(settings.learners):
        progress = workdir / "progress" / f"{learner_name(index)}.json"
        progress.unlink(missing_ok=True)
    session_path(workdir).write_bytes(msgspec.json.encode(settings))


async def _run(settings: DemoSettings, console: Console) -> int:
    session = await anyio.to_thread.run_sync(_Session, settings, console)
    logs: list[IO[bytes]] = []
    use_live = settings.live and console.is_terminal
    try:
        async with open_mailbox(settings.store, must_exist=False) as mailbox:
            with (
                anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
                Live(console=console, auto_refresh=False)
                if use_live
                else contextlib.nullcontext() as live,
            ):
                reader = RunReader.of(mailbox, RunKey.from_env())
                await _check_run(session, mailbox)
                await anyio.to_thread.run_sync(_prepare, settings)
                console.print(
                    f"gradientmail demo: session {settings.session} with {settings.learners} "
                    f"learner processes on {settings.store}; events in "
                    f"{Path(settings.workdir) / 'events'}, logs in "
                    f"{Path(settings.workdir) / 'logs'}",
                    highlight=False,
                    soft_wrap=True,
                )
                await session.start_learners(logs)
                async with anyio.create_task_group() as group:
                    group.start_soon(session.stop_on_signal, signals)
                    group.start_soon(session.wait_learners, group)
                    group.start_soon(session.evaluate_loop, reader)
                    group.start_soon(session.refresh_loop, live)
                await anyio.to_thread.run_sync(session.read_news)
                if not session.interrupted and all(
                    process.returncode == 0 for process in session.processes
                ):
                    await session.evaluate_now(reader)
                if live is not None:
                    live.update(render_board(session.board), refresh=True)
    finally:
        with anyio.CancelScope(shield=True):
            for process in session.processes:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            for log in logs:
                log.close()
    return await _finish(session, console)


async def _finish(session: _Session, console: Console) -> int:
    settings, board = session.settings, session.board
    workdir = Path(settings.workdir)
    plot_path = workdir / "eval-loss.png" if board.history else None
    if plot_path is not None:
        await anyio.to_thread.run_sync(
            functools.partial(
                plot, board.history, plot_path, floor=board.floor, unigram=board.unigram
            )
        )
    console.print(session_summary(board, session.rounds, plot_path))
    failed = {
        learner_name(i): process.returncode
        for i, process in enumerate(session.processes)
        if process.returncode not in (0, None) and not session.interrupted
    }
    document = {
        "session": settings.session,
        "store": settings.store,
        "interrupted": session.interrupted,
        "wall_seconds": board.elapsed,
        "rounds": session.rounds,
        "parameters": board.parameters,
        "loss": {
            "start": board.history[0].loss if board.history else None,
            "final": board.history[-1].loss if board.history else None,
            "floor": board.floor,
            "unigram": board.unigram,
        },
        "learners": {
            name: msgspec.to_builtins(progress) for name, progress in board.progress.items()
        },
        "exit_codes": {learner_name(i): p.returncode for i, p in enumerate(session.processes)},
        "plot": None if plot_path is None else str(plot_path),
    }
    (workdir / "summary.json").write_text(json.dumps(document, indent=2))
    if session.interrupted:
        console.print(
            f"interrupted: the run in {settings.store} is intact; "
            f"`gradientmail status {settings.store}` shows it and "
            f"`gradientmail demo --store {settings.store}` resumes it"
        )
        return 130
    if failed:
        for name, code in failed.items():
            progress = board.progress.get(name)
            reason = progress.error if progress is not None and progress.error else None
            console.print(
                f"[red]{name} failed[/] (exit {code}): "
                f"{reason or 'see ' + str(log_path(workdir, name))}"
            )
        return 1
    return 0


def run_demo(settings: DemoSettings) -> int:
    """Run one session of the demo; the exit status (0, 1 when a learner failed, 130 when
    interrupted). ``UsageError`` when the store cannot be opened."""
    torch.set_num_threads(1)
    console = Console()
    return anyio.run(_run, settings, console, backend=settings.backend)
