"""A learner's publisher task (``_node.learner_driver``): it takes the ``Publish`` actions of
the pure learner off its stream, in order, encodes ``S − B`` in a worker thread, uploads the
blob and then the snapshot, and reports how each publish ended (``PublishEnded``, fed back
to the learner). Under the ``topk`` delta encoding it holds each snapshot's unsent residual
(``protocol.feedback``) until the driver's ``Apply`` resolves it (``resolved``), which hands
an included snapshot's to the merge. On a rank of a sharded group each rank uploads its rows
of a snapshot as a part (``codec.part_spec``); a follower reports it (the group's next tick
carries it) and the leader, once every rank's part is in, writes the snapshot with every
part. Used on the event-loop thread: ``queue``, ``resolved`` and ``close`` by the driver,
``run`` as a task of the node's task group."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from torch import Tensor

from gradientmail._node.runtime import Runtime
from gradientmail._node.sharded import ShardedRank, squares
from gradientmail._node.waits import Waits
from gradientmail.errors import MailboxUnavailable, RecordError
from gradientmail.events.kinds import PublishFailed, SnapshotPublished
from gradientmail.protocol import keys
from gradientmail.protocol.codec import encode_fragment, part_spec
from gradientmail.protocol.feedback import Feedback, encoded
from gradientmail.protocol.group import PartReport
from gradientmail.protocol.learner_inputs import PublishEnded
from gradientmail.protocol.learner_values import Publish
from gradientmail.protocol.mean import l2_norm
from gradientmail.protocol.merge import Merge
from gradientmail.protocol.records import BlobRef, Encoding, FragmentSpec, SnapshotPart
from gradientmail.protocol.records import Snapshot as SnapshotRecord
from gradientmail.protocol.sparse import TOPK, Sparsity, delta_sparsity, sent_as

__all__ = ["Job", "Publisher", "encode_delta"]


@dataclass(frozen=True, slots=True)
class Job:
    """A ``Publish`` and the CUDA event after which its snapshot holds its values (None on
    the CPU)."""

    publish: Publish
    ready: Any


class Publisher:
    """The publisher of one learner (see the module docstring): ``ended`` takes how each
    publish ended, ``waits`` states the share of time the learner waited in each snapshot,
    ``sharded`` is the rank of a sharded group (None: a learner of its own)."""

    def __init__(
        self,
        rt: Runtime,
        ended: Callable[[PublishEnded], None],
        waits: Waits,
        sharded: ShardedRank | None = None,
    ) -> None:
        self._rt = rt
        self._ended = ended
        self._waits = waits
        self._sharded = sharded
        send, receive = anyio.create_memory_object_stream[Job](max_buffer_size=math.inf)
        self._jobs: MemoryObjectSendStream[Job] = send
        self._pending: MemoryObjectReceiveStream[Job] = receive
        self._feedback = Feedback()

    def queue(self, publish: Publish, ready: Any = None) -> None:
        """Publish ``publish`` after those queued before it (``ready``: the CUDA event after
        which its snapshot holds its values)."""
        self._jobs.send_nowait(Job(publish, ready))

    def close(self) -> None:
        """No more snapshots: ``run`` ends once it has drained its jobs."""
        self._jobs.close()

    def resolved(self, fragment: int, round: int, outcome: Merge) -> tuple[Tensor, ...] | None:
        """The round ``round`` of ``fragment`` is being applied as ``outcome``: the error
        feedback's residual the merge adds back to the weights (``Feedback.resolved``)."""
        self._feedback, kept = self._feedback.resolved(fragment, round, outcome)
        return kept

    async def run(self) -> None:
        """Publish each snapshot in turn: ``SnapshotPublished``, or ``PublishFailed`` when the
        store is out of reach for now (``MailboxUnavailable``) or the snapshot's key holds
        another (``RecordError``); its steps stay counted for the fragment's next snapshot.
        A ``StoreAccessError`` propagates: it fails the node at once. Ends when
        ``close`` was called and the jobs are drained.

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
                    self._ended(PublishEnded(publish.fragment, publish.round, ok))

    async def _upload_part(self, job: Job, sharded: ShardedRank) -> PartReport:
        """Encode and upload this rank's rows of ``job``'s snapshot: its report."""
        rt = self._rt
        p = job.publish
        rows = sharded.rows[p.fragment]
        spec = part_spec(rt.specs[p.fragment], rows)
        data, norm, encoding = await self._encoded(job, spec)
        ref = await rt.store.put_blob(data, encoding)
        part = SnapshotPart(delta=ref, rows=tuple(rows))
        return PartReport(sharded.rank, p.round, p.fragment, part, squares(norm))

    async def _publish(self, job: Job) -> None:
        rt = self._rt
        p = job.publish
        started = rt.clock.now()
        sharded = self._sharded
        delta: BlobRef | msgspec.UnsetType = msgspec.UNSET
        parts: tuple[SnapshotPart, ...] | msgspec.UnsetType = msgspec.UNSET
        if sharded is None:
            data, norm, encoding = await self._encoded(job, rt.specs[p.fragment])
            delta = await rt.store.put_blob(data, encoding)
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
            waited=round(self._waits.share(), 4),
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

    async def _encoded(self, job: Job, spec: FragmentSpec) -> tuple[bytes, float | None, Encoding]:
        """The delta blob of ``job``, its norm and its encoding (``sparse.sent_as``), encoded
        in a worker thread; under ``topk`` the share of the snapshot's unsent residual its
        learner keeps (``RunConfig.topk_feedback``) is pending from then on (a final
        snapshot goes out dense and leaves none)."""
        p, config = job.publish, self._rt.config
        encoding = sent_as(config, "delta", final=p.final)
        version = keys.version_of(p.round, config.fragments)
        if encoding != TOPK:
            data, norm = await anyio.to_thread.run_sync(
                encode_delta, job, spec, encoding, config.block_size, version
            )
            return data, norm, encoding
        data, norm, left = await anyio.to_thread.run_sync(
            _encode_topk, job, spec, delta_sparsity(config), config.topk_feedback, version
        )
        self._feedback = self._feedback.taken(p.fragment, p.round, left)
        return data, norm, encoding


def _encode_topk(
    job: Job, spec: FragmentSpec, sparsity: Sparsity, keep: float, version: int
) -> tuple[bytes, float | None, tuple[Tensor, ...]]:
    if job.ready is not None:
        job.ready.synchronize()
    p = job.publish
    data, opened, left = encoded(p.snapshot, p.base, spec, sparsity, keep=keep, version=version)
    return data, l2_norm(opened), left


def encode_delta(
    job: Job, spec: FragmentSpec, encoding: Encoding, block_size: int, version: int
) -> tuple[bytes, float | None]:
    """The blob of ``job``'s delta, a blob of ``version`` (its round's), and its norm."""
    if job.ready is not None:
        job.ready.synchronize()
    p = job.publish
    # S − B piece by piece: no whole copy of the delta (docs/mailbox.md, "Large blobs end to end").
    data = encode_fragment(
        p.snapshot, spec, encoding, block_size=block_size, minus=p.base, version=version
    )
    return data, l2_norm(p.snapshot, minus=p.base)
