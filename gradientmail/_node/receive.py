"""The receive task of a learner: it brings the run's committed records and the versions
they call for to the pure learner (``protocol.learner.Learner``), through its
``LearnerDriver``. No protocol decision is made here, and the ``Learner``
value is never replaced here: every input goes through the driver (``LearnerDriver.feed``).

``Receiver.run`` is one task of the node's task group, on the event-loop thread. Every
``poll_interval`` (``due_poll_interval`` while a round is due: ``Learner.awaiting``;
``wait_poll_interval`` while a step waits on it: ``Learner.wait_until``) it
lists ``records/`` after the newest round fed and feeds each record
(``RecordSeen``); while a round is due, between listings at least ``poll_interval``
apart, it reads the next round's record instead (a poll of a run with many records
costs one read, not a listing of them all). A record that does not decode or verify, or
a gap in the records, stops the feeding there (retried at every poll; one ``PollFailed``
per distinct failure, not one per poll). Then it prepares the versions the learner wants
(``Learner.downloads``): the update, decoded and applied to the base by
``protocol.outer.apply_update`` in a worker thread, or θ rebuilt by ``RunReader.rebuild``
(the checkpoint at or below the record's version and the updates after it;
``VersionReady``). Each fragment's download fails alone
(``DownloadFailed``): a corrupt or missing update falls back to the rebuild, which
gets past a damaged update only when the record is itself a checkpoint (else the fragment
waits for a newer record, at most ``checkpoint_every`` versions), and the other fragments
are prepared anyway.

On a rank of a sharded learner group (``_node.sharded``) it prepares the rank's rows by
ranged reads (``RunReader.rows``: the update's rows added to the base's, or
``RunReader.rebuild_rows``) and keeps them for the group's tick, which feeds a version once
every rank holds it; only the leader lists records (a follower's learner replays the
leader's) and feeds a failure (a follower's own failure is retried at its next poll).
"""

import logging
import math
from collections.abc import Sequence

import anyio.to_thread
from torch import Tensor

from gradientmail._node.learner_driver import LearnerDriver
from gradientmail._node.runtime import Nudge, Runtime
from gradientmail._node.sharded import ShardedRank
from gradientmail.errors import CorruptBlob, MailboxUnavailable, RecordError
from gradientmail.events.kinds import PollFailed
from gradientmail.protocol.checkpoint import check_record
from gradientmail.protocol.layout import Rows
from gradientmail.protocol.learner import Download, Failure, Stage
from gradientmail.protocol.learner_inputs import DownloadFailed, RecordSeen, VersionReady
from gradientmail.protocol.outer import added, apply_update
from gradientmail.protocol.records import FragmentSpec
from gradientmail.protocol.sizes import max_blob_bytes
from gradientmail.reader import RunReader

__all__ = ["Receiver"]

_log = logging.getLogger("gradientmail.learner")


class Receiver:
    """The receive task of the learner ``driver`` drives (see the module docstring).
    ``published``: set once a snapshot of the learner is in the store; it ends an idle
    pause, so that the due pace starts then rather than up to a ``poll_interval`` later."""

    def __init__(
        self,
        rt: Runtime,
        driver: LearnerDriver,
        sharded: ShardedRank | None = None,
        published: Nudge | None = None,
    ) -> None:
        self._rt = rt
        self._driver = driver
        self._sharded = sharded
        self._published = Nudge() if published is None else published
        self._listed_at = -math.inf

    async def run(self) -> None:
        """Forever: feed the new records, prepare the versions they call for, sleep
        ``poll_interval`` (``due_poll_interval`` while a round is due, ``wait_poll_interval``
        while a step waits on one). A listing that fails
        for now (``MailboxUnavailable``) or on a record that does not decode or verify
        (``RecordError``) is retried at every poll and reported (``PollFailed``) once: again
        only when it fails otherwise, or after it worked. A ``StoreAccessError``
        propagates: it fails the node at once."""
        rt = self._rt
        reported: str | None = None
        lists = self._sharded is None or self._sharded.leader
        while True:
            try:
                if lists:
                    await self._receive_records()
                reported = None
            except (MailboxUnavailable, RecordError) as exc:
                if f"{type(exc).__name__}: {exc}" != reported:
                    reported = f"{type(exc).__name__}: {exc}"
                    rt.emit(PollFailed(rt.learner, exc))
            await self._prepare()
            now = rt.clock.now()
            state = self._driver.state
            if state.awaiting(now):
                waiting = state.wait_until(now) is not None
                await rt.clock.sleep(rt.options.pause(due=True, waiting=waiting))
            else:
                await self._published.pause(rt.clock, rt.options.pause(due=False))

    async def _receive_records(self) -> None:
        """Feed the records after the newest one fed, in order: while a round is due
        (``Learner.awaiting``), by reading the next round's record until one is missing
        (one read a poll, however many records the run has); otherwise, and at least every
        ``poll_interval``, from a listing of ``records/``, which also finds a gap. Raises
        ``RecordError`` for a gap or a record that does not decode, verify, describe its
        round or carry the checkpoint its version calls for (``checkpoint.check_record``)."""
        rt = self._rt
        driver = self._driver
        now = rt.clock.now()
        if driver.state.awaiting(now) and now - self._listed_at < rt.options.poll_interval:
            while await self._feed_record(driver.state.seen_round + 1):
                pass
            return
        self._listed_at = now
        for round in await rt.store.record_rounds(after=driver.state.seen_round):
            expected = driver.state.seen_round + 1
            if round != expected:
                raise RecordError(
                    f"records/ jumps from round {expected - 1} to {round}; rounds are "
                    "committed in order, so the store is damaged"
                )
            if not await self._feed_record(round):
                return

    async def _feed_record(self, round: int) -> bool:
        """Feed ``round``'s record (``RecordSeen``) once checked; False when it has none.
        Raises ``RecordError`` as ``_receive_records`` says."""
        rt = self._rt
        record = await rt.store.record(round)
        if record is None:
            return False
        check_record(record, round, rt.config)
        self._driver.feed(RecordSeen(record, rt.clock.now()))
        return True

    async def _prepare(self) -> None:
        """Download every version the learner wants, falling back to θ in the same turn
        when an update fails; one fragment's failure is fed back and stops no other."""
        tried: set[tuple[int, bool]] = set()
        sharded = self._sharded
        while todo := [
            d
            for d in self._driver.state.downloads()
            if (d.fragment, d.base is None) not in tried
            and (sharded is None or sharded.prepared(d.fragment) != d.record.round)
        ]:
            for download in todo:
                tried.add((download.fragment, download.base is None))
                await self._prepare_one(download)

    async def _prepare_one(self, download: Download) -> None:
        driver = self._driver
        fragment, round = download.fragment, download.record.round
        stage: Stage = "theta" if download.base is None else "update"
        failure: Failure
        sharded = self._sharded
        try:
            if sharded is None:
                theta = await self._download(download)
            else:
                theta = await self._download_rows(download, sharded.rows[fragment])
        except (CorruptBlob, RecordError) as exc:
            failure, detail = "corrupt", f"{type(exc).__name__}: {exc}"
        else:
            if theta is not None and sharded is not None:
                sharded.prepare(fragment, round, theta)
                return
            if theta is not None:
                driver.feed(VersionReady(fragment, round, theta))
                return
            failure, detail = "gone", "the blob is gone"
        _log.info("%s: the %s of round %d: %s", self._rt.learner, stage, round, detail)
        if sharded is None or sharded.leader:
            driver.feed(DownloadFailed(fragment, round, stage, failure, detail))

    async def _download(self, download: Download) -> tuple[Tensor, ...] | None:
        """θ of ``download.record`` (None: the blob is gone). Raises ``CorruptBlob`` or
        ``RecordError`` (a ``CodecError``) for bytes that cannot be used."""
        rt = self._rt
        record = download.record
        spec = rt.specs[download.fragment]
        pin = self._driver.pinned
        if download.base is not None:
            data = await rt.store.get_blob(record.update, most=max_blob_bytes(spec))
            if data is None:
                return None
            return await anyio.to_thread.run_sync(_updated, download.base, data, spec, pin)
        rebuilt = await RunReader(rt.store).rebuild(
            download.fragment, record.version, manifest=rt.manifest
        )
        return None if rebuilt is None else _pinned(rebuilt.theta, pin)

    async def _download_rows(self, download: Download, rows: Rows) -> tuple[Tensor, ...] | None:
        """``rows`` of θ of ``download.record`` (None: a blob is gone), read by ranges.
        Raises as ``_download`` does."""
        rt = self._rt
        record = download.record
        reader = RunReader(rt.store)
        if download.base is not None:
            update = await reader.rows(record.update, rt.specs[download.fragment], rows)
            if update is None:
                return None
            return await anyio.to_thread.run_sync(_added, download.base, update)
        rebuilt = await reader.rebuild_rows(
            download.fragment, record.version, rows, manifest=rt.manifest
        )
        return None if rebuilt is None else rebuilt.theta


def _added(base: Sequence[Tensor], update: Sequence[Tensor]) -> tuple[Tensor, ...]:
    try:
        return tuple(added(base, update))
    except ValueError as exc:
        raise RecordError(f"the update does not fit this rank's rows: {exc}") from exc


def _pinned(tensors: Sequence[Tensor], pin: bool) -> tuple[Tensor, ...]:
    return tuple(t.pin_memory() if pin else t for t in tensors)


def _updated(
    base: Sequence[Tensor], data: bytes, spec: FragmentSpec, pin: bool
) -> tuple[Tensor, ...]:
    try:
        return _pinned(apply_update(base, data, spec), pin)
    except ValueError as exc:
        raise RecordError(f"the update does not fit the fragment: {exc}") from exc
