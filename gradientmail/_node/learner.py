"""The driver of the pure learner (``protocol.learner.Learner``): it holds the one current
``Learner`` value, feeds it the step, the records, the downloads and the publishes, and
carries out the actions it answers. No protocol decision is made here.

``LearnerDriver`` is used on the event-loop thread: ``step`` and ``flush_once`` by the
user's task (``Node.step`` and the closing flush), ``run_publisher`` as a task of the node's
task group, and the receive task (``_node.receive.Receiver``) brings the records and the
downloaded versions (``record_seen``, ``version_ready``, ``download_failed``). The one
exception is ``step_quietly``, from the training thread: a step that answers no action
(most steps: nothing to apply, no fragment due) is counted there, without a round trip
through the event loop, which at a step of tens of milliseconds cost the training thread
more than the step's own bookkeeping (two thread switches per step on shared cores). Every
input is one atomic transition of the ``Learner`` value under ``_lock`` (held only while a
pure input computes the next value), so an input of the event loop's tasks and a quiet step
never lose or reorder each other. The ``Learner`` value changes only in this class, every
input has a method here (which, once ``record`` was called, also logs it for a sharded
group's ranks), and every input that answers actions goes through ``_input``, which carries
each of them out right there, on the event-loop thread:

- ``Apply``: ``protocol.merge.merge_into`` on the live parameters (``FragmentAligned``);
- ``Snapshot``: a CPU copy of the fragment (pinned, with a CUDA event, on a GPU), handed
  back to the learner, whose ``Publish`` goes to the publisher task;
- ``Recorded``/``Resolved``/``Dropped``/``Unavailable``: events (``RoundRecorded``,
  ``SnapshotRejected``, ``StepsDropped``, one ``PollFailed``).

``Download`` is not fed back: the receive task asks ``state.downloads()`` for them.
The publisher encodes ``S − B`` in a worker thread, uploads the blob and then the snapshot.
Under the ``topk`` delta encoding it encodes ``S − B`` plus the fragment's error feedback
(``protocol.feedback``), whose value this class holds and resolves with each ``Apply``.

On a rank of a sharded learner group (``sharded``: FSDP2, ``_node.sharded``) the
parameters are the rank's rows and every rank drives its own learner: the leader's is fed
as above (and logs its inputs), a follower's only by ``replay`` of the leader's log. Each
rank's publisher uploads its rows of a snapshot as a part (``codec.part_spec``); a follower
reports it (the group's next tick carries it) and the leader, once every rank's part is in,
writes the snapshot with every part and logs the publish's end, which the followers replay.
"""

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from msgspec import UNSET
from torch import Tensor

from gradientmail._node.runtime import Runtime
from gradientmail._node.sharded import ShardedRank, squares
from gradientmail.errors import MailboxUnavailable, RecordError
from gradientmail.events.kinds import (
    WAITING_WARNING,
    FragmentAligned,
    PollFailed,
    PublishFailed,
    RoundRecorded,
    SnapshotPublished,
    SnapshotRejected,
    StepsDropped,
    Waiting,
)
from gradientmail.protocol import keys
from gradientmail.protocol.aggregation import l2_norm
from gradientmail.protocol.codec import encode_fragment, part_spec
from gradientmail.protocol.feedback import Feedback, encoded
from gradientmail.protocol.group import (
    BeganClosing,
    DownloadFailed,
    DroppedAll,
    Entry,
    Finalized,
    Flushed,
    PartReport,
    PublishEnded,
    RecordSeen,
    Stepped,
    VersionReady,
)
from gradientmail.protocol.learner import (
    Action,
    Apply,
    Download,
    Dropped,
    Failure,
    Learner,
    Publish,
    Recorded,
    Resolved,
    Snapshot,
    Stage,
    Unavailable,
)
from gradientmail.protocol.learner_values import Tensors
from gradientmail.protocol.merge import merge_into
from gradientmail.protocol.records import (
    BlobRef,
    DropReason,
    FragmentSpec,
    RoundRecord,
    RunConfig,
    SnapshotPart,
)
from gradientmail.protocol.records import Snapshot as SnapshotRecord
from gradientmail.protocol.sparse import TOPK, Sparsity, delta_sparsity

__all__ = ["LearnerDriver"]


@dataclass(frozen=True, slots=True)
class _Job:
    """A ``Publish`` and the CUDA event after which its snapshot holds its values (None on
    the CPU)."""

    publish: Publish
    ready: Any


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
        self._sharded = sharded
        self._lock = threading.Lock()
        self._state = learner
        self._params = params
        self._wake = wake
        self._published = published
        self._pin = any(p.is_cuda for group in params for p in group)
        send, receive = anyio.create_memory_object_stream[_Job](max_buffer_size=math.inf)
        self._jobs: MemoryObjectSendStream[_Job] = send
        self._pending: MemoryObjectReceiveStream[_Job] = receive
        self._log: list[Entry] | None = None
        self._feedback = Feedback()
        self._changed = anyio.Event()
        self.waited = 0.0
        """Seconds ``wait_to_step`` has waited in all."""
        self._marks: tuple[tuple[float, float], ...] = ((rt.clock.now(), 0.0),)
        self._waited_for: tuple[str, ...] = ()
        self._warned = 0

    def _waiting(self) -> float:
        """The share of its time this learner waited on rounds (``wait_to_step``) over about
        the last fragment period (its last ``fragments`` snapshots), 0 to 1, noting the
        present as the start of the next snapshot's interval; reports ``Waiting`` when it is
        over ``WAITING_WARNING``, at most once a period."""
        rt = self._rt
        now = rt.clock.now()
        period = rt.config.fragments
        marks = (*self._marks, (now, self.waited))[-(period + 1) :]
        self._marks = marks
        began, before = marks[0]
        share = 0.0 if now <= began else min(1.0, max(0.0, (self.waited - before) / (now - began)))
        self._warned = max(0, self._warned - 1)
        if share > WAITING_WARNING and not self._warned:
            rt.emit(Waiting(rt.learner, round(share, 3), self._waited_for))
            self._warned = period
        return share

    def _note_waits(self, record: RoundRecord) -> None:
        """The learners ``record``'s round took after this learner's snapshot, a step time
        or more later (``Participant.arrived``): whom its waits are for."""
        arrived = {p.learner: p.arrived for p in record.participants if p.arrived is not UNSET}
        mine = arrived.get(self._rt.learner)
        tau = self._state.pace.step_time
        if mine is None or tau is None:
            return
        later = tuple(sorted(n for n, at in arrived.items() if at - mine >= tau))
        if later:
            self._waited_for = later

    @property
    def state(self) -> Learner:
        """The current ``Learner`` value (immutable; read it, never change it)."""
        return self._state

    @property
    def pinned(self) -> bool:
        """Whether the parameters live on a GPU (prepared versions are then pinned)."""
        return self._pin

    def record(self) -> list[Entry]:
        """From now on, append every input of the learner to the list returned, in the
        order it was fed (``protocol.group.Entry``: what the ranks of a sharded group
        replay); an input's tensors are not kept."""
        self._log = []
        return self._log

    def _logged(self, entry: Entry) -> None:
        if self._log is not None:
            self._log.append(entry)

    def step(self, tokens: int, now: float | None = None) -> None:
        """One local step (at ``now``, default the clock's): apply what is prepared,
        snapshot the fragment due. A step that must wait (``wait_to_step``) is the
        caller's to await first."""
        now = self._rt.clock.now() if now is None else now
        self._logged(Stepped(tokens, now))
        self._input(lambda s: s.stepped(tokens, now), wake=False)

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
            state, actions = self._state.stepped(tokens, now)
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
            self.waited += clock.now() - began

    def flush_once(self, now: float | None = None) -> None:
        """One turn of the closing flush (at ``now``, default the clock's): apply what is
        prepared, snapshot what can be."""
        now = self._rt.clock.now() if now is None else now
        self._logged(Flushed(now))
        self._input(lambda s: s.flush(now), wake=False)

    def begin_close(self) -> None:
        """Closing with flush begins: keep a copy of the live model for the final snapshots."""
        models = [tuple(p.detach().to("cpu", copy=True) for p in group) for group in self._params]
        self._logged(BeganClosing())
        self._input(lambda s: (s.began_closing(models), ()), wake=False)

    def finalize(self) -> None:
        """Queue the final snapshots once the flush has settled (``Learner.finalize``)."""
        self._logged(Finalized())
        with self._lock:
            self._state, jobs = self._state.finalize()
        for job in jobs:
            self._jobs.send_nowait(_Job(job, None))

    def drop_all(self, reason: DropReason, detail: str) -> None:
        """Report every fragment's unpublished steps dropped, for ``reason``."""
        self._logged(DroppedAll(reason, detail))
        self._input(lambda s: s.dropped_all(reason, detail), wake=False)

    def record_seen(self, record: RoundRecord, now: float) -> None:
        """The next committed record (the receive task's); wakes the closing flush."""
        self._note_waits(record)
        self._logged(RecordSeen(record, now))
        self._input(lambda s: s.record_seen(record, now), wake=True)

    def version_ready(self, fragment: int, round: int, theta: Tensors) -> None:
        """The version of ``round``'s record of ``fragment`` is prepared (``theta``)."""
        self._logged(VersionReady(fragment, round))
        self._input(lambda s: (s.version_ready(fragment, round, theta), ()), wake=True)

    def download_failed(
        self, fragment: int, round: int, stage: Stage, failure: Failure, detail: str
    ) -> None:
        """Preparing that version failed (``Learner.download_failed``)."""
        self._logged(DownloadFailed(fragment, round, stage, failure, detail))
        self._input(
            lambda s: s.download_failed(fragment, round, stage, failure, detail), wake=False
        )

    def replay(self, entries: Sequence[Entry], prepared: Callable[[int, int], Tensors]) -> None:
        """A follower of a sharded group: feed ``entries`` (the leader's log), in order;
        ``prepared(fragment, round)`` answers this rank's rows of a version the log says
        is ready."""
        for entry in entries:
            match entry:
                case Stepped(tokens=tokens, now=now):
                    self.step(tokens, now)
                case Flushed(now=now):
                    self.flush_once(now)
                case RecordSeen(record=record, now=now):
                    self.record_seen(record, now)
                case VersionReady(fragment=fragment, round=round):
                    self.version_ready(fragment, round, prepared(fragment, round))
                case DownloadFailed(fragment, round, stage, failure, detail):
                    self.download_failed(fragment, round, stage, failure, detail)
                case PublishEnded(fragment=fragment, round=round, ok=ok):
                    self._publish_ended(fragment, round, ok)
                case BeganClosing():
                    self.begin_close()
                case Finalized():
                    self.finalize()
                case DroppedAll(reason=reason, detail=detail):
                    self.drop_all(reason, detail)

    def close_jobs(self) -> None:
        """No more snapshots: the publisher ends once it has drained its jobs."""
        self._jobs.close()

    # -- feeding the learner and carrying out its actions ----------------------------------

    def _input(
        self, answer: Callable[[Learner], tuple[Learner, Sequence[Action]]], *, wake: bool
    ) -> None:
        """The one feed point: what ``answer`` makes of the current value becomes the
        current value (atomically, under ``_lock``), then each action it answered is
        carried out, in order; with ``wake`` the closing flush is woken (the input may let
        it go on)."""
        with self._lock:
            self._state, actions = answer(self._state)
        for action in actions:
            self._carry(action)
        if wake:
            self._changed.set()
            self._wake()

    def _carry(self, action: Action) -> None:
        rt = self._rt
        match action:
            case Apply():
                self._apply(action)
            case Snapshot(fragment=fragment):
                snapshot, ready = self._copy_out(fragment)
                with self._lock:
                    self._state, publish = self._state.took(fragment, snapshot)
                self._jobs.send_nowait(_Job(publish, ready))
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
            case Publish() | Download():
                raise AssertionError(f"{type(action).__name__} is answered, not fed back")

    def _apply(self, a: Apply) -> None:
        self._feedback = self._feedback.resolved(a.fragment, a.round, a.outcome)
        merge_into(
            self._params[a.fragment],
            a.outcome,
            theta=a.theta,
            snapshot=a.snapshot,
            base=a.base,
            rule=a.rule,
            alpha=a.alpha,
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

    # -- the publisher task ----------------------------------------------------------------

    async def run_publisher(self) -> None:
        """Publish each snapshot in turn: ``SnapshotPublished``, or ``PublishFailed`` when the
        store is out of reach for now (``MailboxUnavailable``) or the snapshot's key holds
        another (``RecordError``); its steps stay counted for the fragment's next snapshot.
        A ``StoreAccessError`` propagates: it fails the node at once. Ends when
        ``close_jobs`` was called and the jobs are drained.

        A follower of a sharded group only uploads its part and reports it, or reports
        that it failed (and its own ``PublishFailed``): the leader's publish then fails
        too. The end of the publish comes from the leader's log."""
        sharded = self._sharded
        async with self._pending:
            async for job in self._pending:
                publish = job.publish
                if sharded is not None and not sharded.leader:
                    try:
                        report = await self._upload_part(job, sharded)
                    except MailboxUnavailable as exc:
                        self._rt.emit(PublishFailed(self._rt.learner, publish.round, exc))
                        report = PartReport(
                            sharded.rank, publish.round, publish.fragment, None, None
                        )
                    sharded.report(report)
                    continue
                ok = False
                try:
                    await self._publish(job)
                    ok = True
                except (MailboxUnavailable, RecordError) as exc:
                    self._rt.emit(PublishFailed(self._rt.learner, publish.round, exc))
                finally:
                    self._publish_ended(publish.fragment, publish.round, ok)

    def _publish_ended(self, fragment: int, round: int, ok: bool) -> None:
        self._logged(PublishEnded(fragment, round, ok))
        if ok:
            if self._published is not None:
                self._published()
            self._input(lambda s: s.publish_done(fragment, round), wake=True)
        else:
            self._input(lambda s: s.publish_failed(fragment, round), wake=True)

    async def _upload_part(self, job: _Job, sharded: ShardedRank) -> PartReport:
        """Encode and upload this rank's rows of ``job``'s snapshot: its report."""
        rt = self._rt
        p = job.publish
        rows = sharded.rows[p.fragment]
        spec = part_spec(rt.specs[p.fragment], rows)
        data, norm = await self._encoded(job, spec)
        ref = await rt.store.put_blob(data, rt.config.delta_encoding)
        part = SnapshotPart(delta=ref, rows=tuple(rows))
        return PartReport(sharded.rank, p.round, p.fragment, part, squares(norm))

    async def _publish(self, job: _Job) -> None:
        rt = self._rt
        p = job.publish
        started = rt.clock.now()
        sharded = self._sharded
        delta: BlobRef | msgspec.UnsetType = msgspec.UNSET
        parts: tuple[SnapshotPart, ...] | msgspec.UnsetType = msgspec.UNSET
        if sharded is None:
            data, norm = await self._encoded(job, rt.specs[p.fragment])
            delta = await rt.store.put_blob(data, rt.config.delta_encoding)
            size = len(data)
        else:
            try:
                own = await self._upload_part(job, sharded)
                sharded.report(own)
                gathered = await sharded.gathered(p.round, p.fragment)
            finally:
                sharded.end(p.round, p.fragment)
            parts, norm = gathered.snapshot_parts()
            assert own.part is not None
            size = own.part.delta.size
        snapshot = SnapshotRecord(
            learner=rt.learner,
            round=p.round,
            fragment=p.fragment,
            base_version=p.base_version,
            steps=p.steps,
            tokens=p.tokens,
            delta=delta,
            norm=norm,
            closing=True if p.closing else msgspec.UNSET,
            final=True if p.final else msgspec.UNSET,
            parts=parts,
            step_time=msgspec.UNSET if p.step_time is None else min(round(p.step_time, 6), 1e9),
            waited=round(self._waiting(), 4),
        )
        if not await rt.store.put_snapshot(snapshot):
            raise RecordError(
                f"{keys.snapshot(p.round, rt.learner)} already holds another snapshot (an "
                "earlier run of this learner id, or a forgery); these steps go out with the "
                "fragment's next round"
            )
        seconds = rt.clock.now() - started
        rt.emit(
            SnapshotPublished(rt.learner, p.round, p.fragment, p.steps, p.tokens, size, seconds)
        )

    async def _encoded(self, job: _Job, spec: FragmentSpec) -> tuple[bytes, float | None]:
        """The delta blob of ``job`` and its norm, encoded in a worker thread; under
        ``topk`` the error feedback's residual of the snapshot is pending from then on."""
        p, config = job.publish, self._rt.config
        if config.delta_encoding != TOPK:
            return await anyio.to_thread.run_sync(_encode_delta, job, spec, config)
        residual = self._feedback.residual(p.fragment)
        data, norm, left = await anyio.to_thread.run_sync(
            _encode_topk, job, spec, residual, delta_sparsity(config)
        )
        self._feedback = self._feedback.taken(p.fragment, p.round, left)
        return data, norm


def _encode_topk(
    job: _Job, spec: FragmentSpec, residual: tuple[Tensor, ...] | None, sparsity: Sparsity
) -> tuple[bytes, float | None, tuple[Tensor, ...]]:
    if job.ready is not None:
        job.ready.synchronize()
    p = job.publish
    data, opened, left = encoded(p.snapshot, p.base, residual, spec, sparsity)
    return data, l2_norm(opened), left


def _encode_delta(job: _Job, spec: FragmentSpec, config: RunConfig) -> tuple[bytes, float | None]:
    if job.ready is not None:
        job.ready.synchronize()
    p = job.publish
    # S − B piece by piece: no whole copy of the delta (docs/mailbox.md, "Large blobs end to end").
    data = encode_fragment(
        p.snapshot, spec, config.delta_encoding, block_size=config.block_size, minus=p.base
    )
    return data, l2_norm(p.snapshot, minus=p.base)
