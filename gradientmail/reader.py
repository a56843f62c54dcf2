"""Reading a run: the one read path of ``status``, ``export``, ``load``, the demo and a node's
recovery.

``RunReader`` reads through a ``Store`` and never writes. Everything it returns went through
the store's checks: objects decoded strictly, blobs verified against their sha256, junk at
create-once keys skipped for its successor, and in a signed run every manifest, record and
claim verified under the run key and the run's id. A reader without the key refuses a
signed run (``RunMismatch``) unless it was opened ``unverified``, and then says so
(``RunReader.verified`` is False): nothing it shows from a signed run is vouched for.

``load(source, model)`` puts the newest committed weights of a run into a module.

Runs in the caller's task; blob decoding goes to a worker thread. Transient store failures
are retried a few times (``attempts``) and then propagate as ``MailboxUnavailable``;
cancellation stops the reads in flight and leaves the reader usable. Reading records and
leases (``manifest``, ``observe``) does not import torch; rebuilding θ does.
"""

import contextlib
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from gradientmail import mailbox as mailboxes
from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import CorruptBlob, NoRun, RecordError, RunMismatch, UsageError
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import check_record
from gradientmail.protocol.records import BlobRef, FragmentSpec, Manifest, RoundRecord
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

if TYPE_CHECKING:
    from torch import Tensor, nn

    from gradientmail._rebuild import Rebuilder, Rebuilt
    from gradientmail.protocol.codec import Rows

__all__ = [
    "Newest",
    "Observation",
    "Rebuilt",
    "RunReader",
    "Source",
    "check_model",
    "load",
    "open_mailbox",
]

_ATTEMPTS = 4
"""Tries of each read by a reader opened with ``RunReader.of`` before it gives up."""
_RELIST = 5
"""How many listings in a row that show no newer record ``newest`` takes while a θ blob is
gone, before it raises ``CorruptBlob``."""
_CONCURRENT_READS = 16


@dataclass(frozen=True, slots=True)
class Newest:
    """The newest committed version of every fragment: its θ (fp32, CPU, in spec order), its
    version, and the record that made it (None for Θ⁰); ``round`` is the newest committed
    round (-1 on a fresh run)."""

    round: int
    versions: tuple[int, ...]
    thetas: tuple[tuple["Tensor", ...], ...]
    records: tuple[RoundRecord | None, ...]

    def sources(self, manifest: Manifest) -> list["Source"]:
        """Where each fragment's θ came from."""
        return [
            Source(
                fragment=spec.index,
                version=version,
                round=None if record is None else record.round,
                tensors=len(spec.params),
                parameters=spec.numel,
            )
            for spec, version, record in zip(
                manifest.fragments, self.versions, self.records, strict=True
            )
        ]

    def state_dict(self, manifest: Manifest) -> dict[str, "Tensor"]:
        """Every parameter by name, cast back to its dtype in the model."""
        from gradientmail.protocol.fragments import assembled

        return assembled(manifest.fragments, self.thetas)


@dataclass(frozen=True, slots=True)
class Source:
    """Where fragment ``fragment``'s tensors came from: ``version`` committed by ``round``
    (None for Θ⁰), ``tensors`` tensors of ``parameters`` elements."""

    fragment: int
    version: int
    round: int | None
    tensors: int
    parameters: int


@dataclass(frozen=True, slots=True)
class Observation:
    """One reading of a run for ``status``.

    ``records`` holds every round record read so far by round; ``leases`` maps a node to
    ``(newest beat, beats in the store, role of the newest beat)``; ``pending`` is the first
    round without a record, the learners with a snapshot in it and its claimants in claim
    order (``"?"``: a claim that names nobody); ``problems`` are objects skipped as junk;
    ``verified`` is False when a signed run was read without its key.
    """

    url: str
    manifest: Manifest
    records: Mapping[int, RoundRecord]
    leases: Mapping[str, tuple[int, int, keys.Role]]
    pending: int
    snapshots: tuple[str, ...]
    claims: tuple[str, ...]
    problems: tuple[str, ...] = ()
    verified: bool = True


class RunReader:
    """Read-only access to the run in ``store`` (see the module docstring). Reuse one reader
    to re-read cheaply: round records never change, so each is read once."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._manifest: Manifest | None = None
        self._records: dict[int, RoundRecord] = {}

    @functools.cached_property
    def _rebuilder(self) -> "Rebuilder":
        from gradientmail._rebuild import Rebuilder

        return Rebuilder(self.store, self._need)

    @classmethod
    def of(
        cls,
        mailbox: Mailbox,
        run_key: RunKey | None = None,
        *,
        unverified: bool = False,
        attempts: int | None = _ATTEMPTS,
    ) -> "RunReader":
        """A reader of the run in ``mailbox``, checking signatures with ``run_key``. With
        ``unverified`` (and no key) a signed run is read without any check instead of
        refused. ``attempts`` bounds each read's tries (None: retry until cancelled)."""
        return cls(Store(mailbox, run_key=run_key, unverified=unverified, attempts=attempts))

    def __repr__(self) -> str:
        return f"RunReader({self.store.mailbox!r}, records={len(self._records)})"

    @property
    def verified(self) -> bool:
        """Whether what this reader returns is checked: False only for a signed run read
        without its key (``unverified``)."""
        manifest = self._manifest
        signed = manifest is not None and isinstance(manifest.key_id, str)
        return not signed or self.store.run_key is not None

    async def manifest(self) -> Manifest:
        """The run's manifest. ``NoRun`` when there is none (saying whether someone is
        creating it); ``RunMismatch`` for a signed run and a reader without its key (unless
        ``unverified``), or the other way round."""
        if self._manifest is None:
            manifest = await self.store.manifest()
            if manifest is None:
                claims = await self.store.create_claims()
                if claims:
                    who = claims[-1][1] or "someone"
                    raise NoRun(
                        f"no run yet: {who} is creating one (no manifest written); "
                        "try again in a moment"
                    )
                raise NoRun(
                    "no run here (no manifest); a run is created by the first node that "
                    "joins it, e.g. `gradientmail demo --store URL`"
                )
            self._manifest = manifest
        return self._manifest

    async def newest(
        self,
        manifest: Manifest | None = None,
        *,
        initial: bool = False,
        clock: Clock | None = None,
        poll: float = 0.05,
        tries: int | None = _RELIST,
        rows: Sequence["Rows"] | None = None,
    ) -> Newest:
        """The newest committed θ of every fragment (with ``initial``: Θ⁰).

        A θ blob collected between the listing and the read means newer records exist: the
        listing is taken again after ``poll`` seconds. After ``tries`` listings in a row that
        show no newer record (None: never), ``CorruptBlob`` says the store lacks a blob its
        newest records name: collection never deletes what they name, so it will not come
        back. With ``rows`` (one ``codec.Rows`` per fragment) the θ are those rows only, read
        by ranges (``rebuild_rows``): a rank of a sharded learner group.
        Raises ``CorruptBlob`` / ``RecordError`` for damaged blobs.
        """
        manifest = manifest if manifest is not None else await self.manifest()
        clock = clock if clock is not None else MonotonicClock()
        stalled, seen = 0, -2
        while tries is None or stalled < tries:
            newest = await self._newest_once(manifest, initial, rows)
            if isinstance(newest, Newest):
                return newest
            stalled, seen = (stalled + 1 if newest == seen else 1), newest
            await clock.sleep(poll)
        raise CorruptBlob(
            f"a blob that the newest records (round {seen}) name is gone, and {tries} listings "
            f"{poll} s apart showed no newer record: the store lacks it; restore it or start a "
            "new run from an export"
        )

    async def _newest_once(
        self, manifest: Manifest, initial: bool, rows: Sequence["Rows"] | None
    ) -> Newest | int:
        """The newest θ; else (a blob is gone) the newest round listed."""
        fragments = manifest.config.fragments
        rounds = [] if initial else await self.store.record_rounds()
        listed = rounds[-1] if rounds else -1
        newest: list[RoundRecord | None] = [None] * fragments
        for round in rounds[-fragments:]:
            record = await self._record(round, manifest)
            if record is None:
                return listed
            newest[record.fragment] = record
        versions = tuple(0 if r is None else r.version for r in newest)
        rebuilt = await self.rebuild_all(manifest, versions, rows)
        if rebuilt is None:
            return listed
        return Newest(
            round=listed,
            versions=versions,
            thetas=tuple(r.theta for r in rebuilt),
            records=tuple(newest),
        )

    async def rebuild_all(
        self, manifest: Manifest, versions: Sequence[int], rows: Sequence["Rows"] | None = None
    ) -> list["Rebuilt"] | None:
        """``rebuild`` of every fragment at ``versions`` (with ``rows``, one ``codec.Rows``
        per fragment: ``rebuild_rows``), two at a time (``_rebuild``; one's reads
        overlap another's decoding, and replays run on two cores); None when a blob is
        gone. A failure is raised as itself (``gather``), the others cancelled."""
        return await self._rebuilder.rebuild_all(manifest, versions, rows)

    async def rebuild(
        self,
        fragment: int,
        version: int,
        *,
        momentum: bool = False,
        start: "Rebuilt | None" = None,
        manifest: Manifest | None = None,
    ) -> "Rebuilt | None":
        """Version ``version`` of ``fragment`` (and with ``momentum`` its outer momentum)
        from the store: the newest checkpoint at or below it (Θ⁰ for 0), or ``start`` when
        that is between the checkpoint ``checkpoint.base`` guarantees and ``version`` (and
        holds the momentum if it is asked for), then every round after it replayed
        (``protocol.checkpoint``: bit for bit what the syncer committed). The momentum
        replay reads the deltas of each round's participants; a run whose outer step keeps
        no state (``checkpoint.stateful``) has none to replay, and its momentum is None.

        None when a blob it needs is gone (collected: newer records replaced the version).
        Raises ``RecordError`` for a missing or unusable record (one lacking its
        checkpoint, ``checkpoint.check_record``) or a participant's snapshot that is gone,
        and ``CorruptBlob`` / ``CodecError`` for damaged blobs.
        """
        manifest = manifest if manifest is not None else await self.manifest()
        return await self._rebuilder.rebuild(
            manifest, fragment, version, momentum=momentum, start=start
        )

    async def rows(self, ref: BlobRef, spec: FragmentSpec, rows: "Rows") -> list["Tensor"] | None:
        """``rows`` of each parameter of the blob ``ref`` of ``spec`` (the tensors of
        ``codec.part_spec``), read by ranges (``Store.blob_ranges``: its header, then the
        bytes of those rows) and decoded in a worker thread; a ``topk`` blob, whose rows
        have no fixed place, is read whole. None when the blob is gone. Raises
        ``CorruptBlob`` and ``CodecError`` for bytes that fail their checks."""
        return await self._rebuilder.rows(ref, spec, rows)

    async def rebuild_rows(
        self, fragment: int, version: int, rows: "Rows", *, manifest: Manifest | None = None
    ) -> "Rebuilt | None":
        """``rows`` of θ of ``fragment`` at ``version`` (``rebuild`` without the momentum,
        each blob read by ranges: ``rows``): the same bits as those rows of ``rebuild``'s
        θ. None when a blob it needs is gone; raises as ``rebuild`` does."""
        manifest = manifest if manifest is not None else await self.manifest()
        return await self._rebuilder.rebuild_rows(manifest, fragment, version, rows)

    async def _record(self, round: int, manifest: Manifest) -> RoundRecord | None:
        """The record of ``round`` (cached: records never change), checked against the run
        (``checkpoint.check_record``); None when there is none."""
        record = self._records.get(round)
        if record is None:
            record = await self.store.record(round)
            if record is None:
                return None
            check_record(record, round, manifest.config)
            self._records[round] = record
        return record

    async def _need(self, round: int, manifest: Manifest) -> RoundRecord:
        record = await self._record(round, manifest)
        if record is None:
            raise RecordError(
                f"records/{round:010d} is missing, but a committed version after it needs it"
            )
        return record

    async def observe(self, url: str) -> Observation:
        """Read the manifest (once), new round records, leases and the pending round."""
        manifest = await self.manifest()
        known = max(self._records, default=-1)
        fresh = await self.store.record_rounds(after=known)
        limiter = anyio.CapacityLimiter(_CONCURRENT_READS)

        async def one(round: int) -> None:
            async with limiter:
                record = await self.store.record(round)
            if record is not None:
                self._records[round] = record

        async with anyio.create_task_group() as group:
            for round in fresh:
                group.start_soon(one, round)
        leases: dict[str, tuple[int, int, keys.Role]] = {}
        for key in await self.store.list_keys(keys.LEASES):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                learner, beat, role = parsed
                newest, count, newest_role = leases.get(learner, (-1, 0, role))
                if beat > newest:
                    newest, newest_role = beat, role
                leases[learner] = (newest, count + 1, newest_role)
        pending = max(self._records, default=-1) + 1
        claims = await self.store.round_claims(pending)
        return Observation(
            url=url,
            manifest=manifest,
            records=dict(self._records),
            leases=leases,
            pending=pending,
            snapshots=tuple(await self.store.snapshot_learners(pending)),
            claims=tuple(claimant or "?" for _, claimant in claims),
            problems=tuple(f"{key}: {why}" for key, why in self.store.ignored.items()),
            verified=self.verified,
        )


async def load(
    source: str | Mailbox, model: "nn.Module", *, run_key: RunKey | str | None = None
) -> list[Source]:
    """Load the newest committed weights of the run at ``source`` (a URL, a directory or an
    open ``Mailbox``) into ``model``'s parameters, in place, and return where each fragment
    came from.

    ``run_key`` (default: ``GRADIENTMAIL_RUN_KEY``, else none) verifies a signed run; a
    signed run without it raises ``RunMismatch``. Also ``RunMismatch`` when the model is not
    the run's (naming the first difference; the model is left untouched), ``NoRun`` when
    there is no run, ``MailboxUnavailable`` when the store stays out of reach over a few
    tries. Buffers are not part of a run and are left as they are.
    """
    key = _key(run_key)
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(source, str):
            box = await stack.enter_async_context(open_mailbox(source, must_exist=True))
        else:
            box = source
        reader = RunReader.of(box, key)
        manifest = await reader.manifest()
        named = list(model.named_parameters())
        check_model(manifest, named)
        newest = await reader.newest(manifest)
    import torch

    by_name = dict(named)
    with torch.no_grad():
        for name, value in newest.state_dict(manifest).items():
            by_name[name].copy_(value)
    return newest.sources(manifest)


def check_model(manifest: Manifest, named: Sequence[tuple[str, "Tensor"]]) -> None:
    """Raise ``RunMismatch`` naming the first difference when the named parameters are not
    the model of ``manifest``'s run."""
    from gradientmail.protocol.fragments import mismatch, signature

    config = manifest.config
    try:
        ours = signature(named, config.fragments, config.pattern)
    except ValueError as exc:
        raise RunMismatch(f"this model cannot be split as the run's is: {exc}") from exc
    problem = mismatch(manifest.fragments, ours)
    if problem is not None:
        raise RunMismatch(problem)


def _key(run_key: RunKey | str | None) -> RunKey | None:
    if run_key is None:
        return RunKey.from_env()
    return run_key if isinstance(run_key, RunKey) else RunKey(run_key)


@contextlib.asynccontextmanager
async def open_mailbox(url: str, *, must_exist: bool) -> AsyncIterator[Mailbox]:
    """Open the mailbox ``url`` names (``gradientmail.mailbox.open``) for the block.

    With ``must_exist``, a local directory that is not there is a ``UsageError`` rather than
    being created by entering the mailbox, so reading never leaves an empty store behind. A
    URL the opener refuses is a ``UsageError`` naming it.
    """
    try:
        box = mailboxes.open(url)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if (
        must_exist
        and isinstance(box, LocalMailbox)
        and not await anyio.Path(box.directory).is_dir()
    ):
        raise UsageError(f"{url}: no such directory, so no run there")
    async with box:
        yield box
