"""The driver of the pure learner (``protocol.learner.Learner``): it holds the one current
``Learner`` value, feeds it the inputs (``protocol.learner_inputs.Input``: the steps, the
records, the downloads, the publishes, the close) and carries out the actions it answers.
No protocol decision is made here.

``LearnerDriver`` is used on the event-loop thread: ``step``, ``flush_once`` and
``begin_close`` by the user's task, ``feed`` by the receive task (records, downloaded
versions) and by the publisher (``_node.publisher``: how each publish ended). The one
exception is ``step_quietly``, from the training thread: a step that answers no action is
counted there (why: docs/architecture.md, "Where things run"). Every input is one atomic
transition of the ``Learner`` value (``Learner.handle``) under ``_lock``, held only while
the pure input computes, so no input loses or reorders another. The ``Learner`` value
changes only in this class; every input goes through ``feed`` (logged for a sharded group's
ranks once ``record`` was called), which carries out the actions it answered on the
event-loop thread: ``Apply`` (``merge.merge_into`` on the live parameters,
``FragmentAligned``), ``TakeSnapshot`` (a CPU copy, pinned with a CUDA event on a GPU, handed
back through ``Learner.took``), ``Publish`` (to the publisher), and events for
``Recorded``, ``Resolved``, ``Dropped`` and ``Unavailable``. The receive task asks
``state.downloads()`` itself.

On a rank of a sharded group (``_node.sharded``) every rank drives its own learner over its
rows, a follower's only by ``replay`` of the leader's log; the leader's publisher writes the
snapshot once every rank's part is in (docs/node.md, "Sharded learners").
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch
from torch import Tensor

from gradientmail._node.publisher import Publisher
from gradientmail._node.runtime import Runtime
from gradientmail._node.sharded import ShardedRank
from gradientmail._node.waits import Waits
from gradientmail.errors import RecordError
from gradientmail.events.kinds import (
    FragmentAligned,
    PollFailed,
    RoundRecorded,
    SnapshotRejected,
    StepsDropped,
)
from gradientmail.protocol.learner import (
    Action,
    Apply,
    Download,
    Dropped,
    Learner,
    Publish,
    Recorded,
    Resolved,
    TakeSnapshot,
    Unavailable,
)
from gradientmail.protocol.learner_inputs import (
    BeganClosing,
    Flushed,
    Input,
    PublishEnded,
    RecordSeen,
    Stepped,
    Synced,
    VersionReady,
    without_tensors,
)
from gradientmail.protocol.learner_values import Tensors
from gradientmail.protocol.merge import merge_into

__all__ = ["LearnerDriver"]

_WAKES = (RecordSeen, VersionReady, PublishEnded)
"""The inputs that may let a closing flush (or a step waiting on a version) go on."""


class LearnerDriver:
    """Drives one ``Learner`` over the live ``params`` (one tuple per fragment; a sharded
    rank's rows, ``sharded``); see the module docstring. ``wake`` is called after anything
    that may let a closing flush go on, ``published`` (when given) once a snapshot is in
    the store."""

    def __init__(
        self,
        rt: Runtime,
        learner: Learner,
        params: tuple[tuple[Tensor, ...], ...],
        wake: Callable[[], None],
        sharded: ShardedRank | None = None,
        published: Callable[[], None] | None = None,
    ) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._state = learner
        self._params = params
        self._wake = wake
        self._published = published
        self._pin = any(p.is_cuda for group in params for p in group)
        self._log: list[Input] | None = None
        self._waits = Waits(rt)
        self._publisher = Publisher(rt, self.feed, self._waits, sharded)
        self._changed = anyio.Event()

    @property
    def state(self) -> Learner:
        """The current ``Learner`` value (immutable; read it, never change it)."""
        return self._state

    @property
    def pinned(self) -> bool:
        """Whether the parameters live on a GPU (prepared versions are then pinned)."""
        return self._pin

    @property
    def waited(self) -> float:
        """Seconds ``wait_to_step`` has waited in all."""
        return self._waits.waited

    def record(self) -> list[Input]:
        """From now on, append every input fed to the list returned, in order, without its
        tensors (``learner_inputs.without_tensors``): the log the ranks of a sharded group
        replay."""
        self._log = []
        return self._log

    def feed(self, input: Input) -> None:
        """Feed ``input`` to the learner (``Learner.handle``, atomically) and carry out the
        actions it answers, in order; log it first (``record``). A ``RecordSeen`` notes
        whom this learner's waits are for; a ``PublishEnded`` that is ``ok`` calls
        ``published``; the inputs that may let a closing flush go on wake it."""
        if isinstance(input, RecordSeen):
            self._waits.note(input.record, self._state.pace.step_time)
        if self._log is not None:
            self._log.append(without_tensors(input))
        if isinstance(input, PublishEnded) and input.ok and self._published is not None:
            self._published()
        with self._lock:
            self._state, actions = self._state.handle(input)
        for action in actions:
            self._carry(action)
        if isinstance(input, _WAKES):
            self._changed.set()
            self._wake()

    def step(self, tokens: int, now: float | None = None) -> None:
        """One local step (``Stepped``, at ``now``, default the clock's). A step that must
        wait (``wait_to_step``) is the caller's to await first."""
        self.feed(Stepped(tokens, self._rt.clock.now() if now is None else now))

    @property
    def synchronous(self) -> bool:
        """Whether a round's version is applied before the step after its snapshot
        (``RunConfig.overlap`` 0): ``step`` waits for it and then ``sync``."""
        return self._state.config.applied_after == 0

    def sync(self) -> None:
        """Apply what is prepared without counting a step (``Synced``), after the wait of a
        synchronous learner's step."""
        self.feed(Synced(self._rt.clock.now()))

    def step_quietly(self, tokens: int) -> bool:
        """From the training thread, while the model is not changing: count one local step
        of ``tokens`` at the clock's time if it answers no action; True if it was counted.
        False leaves everything as it was: the step has something to apply or a fragment
        due, or must wait (or the driver keeps a log for a sharded group's ranks), and the
        caller makes it an ordinary ``step`` on the event-loop thread."""
        if self._log is not None:
            return False
        now = self._rt.clock.now()
        with self._lock:
            if self._state.wait_until(now) is not None:
                return False
            state, actions = self._state.handle(Stepped(tokens, now))
            if actions:
                return False
            self._state = state
        return True

    async def wait_to_step(self) -> None:
        """Return once the next step may be counted (``Learner.wait_until``, with
        ``RunConfig.overlap``): woken by every input that may prepare a version, and at the
        latest when the wait's time is up."""
        clock = self._rt.clock
        began = clock.now()
        waited = False
        while (until := self._state.wait_until(clock.now())) is not None:
            waited = True
            self._changed = anyio.Event()
            with anyio.move_on_after(until - clock.now()):
                await self._changed.wait()
        if waited:
            self._waits.waited += clock.now() - began

    def flush_once(self, now: float | None = None) -> None:
        """One turn of the closing flush (``Flushed``, at ``now``, default the clock's)."""
        self.feed(Flushed(self._rt.clock.now() if now is None else now))

    def begin_close(self) -> None:
        """Closing with flush begins (``BeganClosing``) with a copy of the live model."""
        self.feed(BeganClosing(self._model()))

    def replay(self, entries: Sequence[Input], prepared: Callable[[int, int], Tensors]) -> None:
        """A follower of a sharded group: feed ``entries`` (the leader's log), in order, each
        with this rank's own tensors: ``prepared(fragment, round)`` answers its rows of a
        version the log says is ready, a ``BeganClosing`` takes a copy of its live rows."""
        for entry in entries:
            match entry:
                case VersionReady(fragment=fragment, round=round):
                    self.feed(VersionReady(fragment, round, prepared(fragment, round)))
                case BeganClosing():
                    self.feed(BeganClosing(self._model()))
                case _:
                    self.feed(entry)

    async def run_publisher(self) -> None:
        """The publisher task (``Publisher.run``): ends when ``close_jobs`` was called and
        the snapshots queued are published."""
        await self._publisher.run()

    def close_jobs(self) -> None:
        """No more snapshots: the publisher ends once it has drained its jobs."""
        self._publisher.close()

    # -- carrying out the learner's actions ------------------------------------------------

    def _model(self) -> tuple[Tensors, ...]:
        return tuple(
            tuple(p.detach().to("cpu", copy=True) for p in group) for group in self._params
        )

    def _carry(self, action: Action) -> None:
        rt = self._rt
        match action:
            case Apply():
                self._apply(action)
            case TakeSnapshot(fragment=fragment):
                snapshot, ready = self._copy_out(fragment)
                with self._lock:
                    self._state, publish = self._state.took(fragment, snapshot)
                self._publisher.queue(publish, ready)
            case Publish():
                self._publisher.queue(action)
            case Recorded(record=record):
                rt.emit(RoundRecorded(rt.learner, record))
            case Resolved(resolution=r) if r.outcome == "rejected" and r.reason is not None:
                rt.emit(
                    SnapshotRejected(rt.learner, r.round, r.fragment, r.reason, r.steps, r.tokens)
                )
            case Resolved():
                pass
            case Dropped(fragment, steps, tokens, reason, detail):
                rt.emit(StepsDropped(rt.learner, fragment, steps, tokens, reason, detail))
            case Unavailable(detail=detail):
                rt.emit(PollFailed(rt.learner, RecordError(detail)))
            case Download():
                raise AssertionError("a Download is asked for (Learner.downloads), not answered")

    def _apply(self, a: Apply) -> None:
        kept = self._publisher.resolved(a.fragment, a.round, a.outcome)
        merge_into(
            self._params[a.fragment],
            a.outcome,
            theta=a.theta,
            snapshot=a.snapshot,
            base=a.base,
            rule=a.rule,
            alpha=a.alpha,
            kept=kept,
            non_blocking=self._pin,
        )
        rt = self._rt
        rt.emit(FragmentAligned(rt.learner, a.round, a.fragment, a.version, a.step, a.lag))
        self._wake()

    def _copy_out(self, fragment: int) -> tuple[tuple[Tensor, ...], Any]:
        params = self._params[fragment]
        if not self._pin:
            return tuple(p.detach().to("cpu", copy=True) for p in params), None
        copies = []
        for p in params:
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            host.copy_(p.detach(), non_blocking=True)
            copies.append(host)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return tuple(copies), event
