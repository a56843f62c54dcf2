"""The typed layer over a mailbox: the only place that turns a run's bytes into records.

``Store`` wraps one ``Mailbox`` for one node. Every operation

- retries ``MailboxUnavailable`` with backoff (``mailbox.retrying``) on the node's clock, up
  to ``max_retry_delay`` between tries, forever unless the call says otherwise; every other
  error propagates at once;
- decodes what it reads strictly (``RecordError`` for a malformed object) and verifies every
  blob against its sha256 (``CorruptBlob``);
- counts the requests it makes by kind and the bytes it moves, for ``Store.stats``.

Everything read is hostile until checked. The manifest and round records are create-once
keys that a junk object could block for good; here a manifest or record that does not decode,
does not verify (signed run) or does not describe its key's round is skipped, and readers and
writers alike move on to the key's next successor (``keys.record_slot``,
``keys.manifest_slot``): the first good object in that order is the one, for every honest
node. Skipped keys are remembered (so each is read once) and listed in ``Store.ignored``.
Claims count only in the run of numbers from 0. In a signed run every signature covers the
run's id (``Manifest.run_id``, drawn by ``create_manifest``), learned from the manifest.

Create-once writes whose reply may have been lost are settled here, once: a
``put_if_absent`` that failed transiently and whose retry then finds the key taken reads the
object back, and the write counts as ours when the bytes are ours (claims and records name
their writer, so equal bytes cannot be someone else's).

Runs in the node's tasks on the event loop; hashing of large payloads goes to a worker
thread (``anyio.to_thread``). Cancellation interrupts the request in progress; a cancelled
create-once write may or may not have landed (the caller's next read tells).
"""

import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from gradientmail import _blobs
from gradientmail._blobs import hashed, sha256
from gradientmail._history import History
from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import MailboxUnavailable, RecordError, SignatureError
from gradientmail.mailbox import Mailbox, ObjectRefused, RangedMailbox, retrying
from gradientmail.protocol import keys
from gradientmail.protocol.chain import Stored
from gradientmail.protocol.identities import IDENTITIES, LearnerKey, Signing
from gradientmail.protocol.records import (
    MAX_MANIFEST_BYTES,
    MAX_RECORD_BYTES,
    BlobRef,
    CreateClaim,
    InitMarker,
    LeaseBeat,
    Manifest,
    RoundClaim,
    RoundRecord,
    Snapshot,
    _Object,
    decode,
    encode,
)
from gradientmail.protocol.signing import Problem, RunKey, check_manifest

__all__ = ["Store", "StoreStats", "sha256"]

_log = logging.getLogger("gradientmail.store")

T = TypeVar("T")
S = TypeVar("S", bound=_Object)

_CLAIM_CACHE_ROUNDS = 64
"""How many rounds behind the newest asked about a claim body stays remembered."""
_JUNK_KEPT = 1 << 16
"""How many junk keys a store remembers (the newest): forgetting one costs a read again."""
_IGNORED_SHOWN = 100
"""How many skipped keys ``Store.ignored`` keeps (the newest)."""


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What one store has moved: bytes written and read, and requests by kind (``put``,
    ``get``, ``list``, ``delete``; retries included)."""

    bytes_up: int = 0
    bytes_down: int = 0
    requests: Mapping[str, int] = field(default_factory=dict)


class Store:
    """Typed, counted, retried access to one run's objects in ``mailbox``.

    ``attempts`` bounds the tries of each operation (None: retry transient failures until
    the operation succeeds or is cancelled). With ``run_key`` (a signed run) every object it
    writes is signed and every object it reads is checked: a manifest or record that does
    not verify raises ``SignatureError``, a claim that does not verify names nobody, and a
    snapshot comes with its problem for the round to reject. The store does not own the
    mailbox: whoever opened it closes it.

    ``unverified`` (read-only use, without ``run_key``): read a signed run without checking
    anything, for a reader that says so (``RunReader``); otherwise a signed run's manifest
    read without its key raises ``RunMismatch``. ``learner_key``: this node's own key in a
    run with learner identities (``protocol.identities``).
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        clock: Clock | None = None,
        max_retry_delay: float = 30.0,
        attempts: int | None = None,
        run_key: RunKey | None = None,
        unverified: bool = False,
        learner_key: LearnerKey | None = None,
    ) -> None:
        self.mailbox = mailbox
        self._run_key = run_key
        self.signing = Signing(run_key, learner_key)
        self._unverified = unverified and run_key is None
        self._run = ""
        self._fragments: int | None = None
        self._junk: dict[str, None] = {}
        self._ignored: dict[str, str] = {}
        self._history = History(checked=not self._unverified)
        self._beats: dict[str, bool] = {}
        self._snapshots: dict[int, dict[str, tuple[Snapshot, Problem | None]]] = {}
        self._clock = clock if clock is not None else MonotonicClock()
        self._max_delay = max_retry_delay
        self._attempts = attempts
        self._bytes_up = 0
        self._bytes_down = 0
        self._requests = {"put": 0, "get": 0, "list": 0, "delete": 0}
        self._claimants: dict[int, dict[int, str]] = {}

    @property
    def run_key(self) -> RunKey | None:
        return self._run_key

    @property
    def ignored(self) -> Mapping[str, str]:
        """The newest keys skipped as junk (malformed, unverified or misfiled objects at
        create-once keys), each with why."""
        return dict(self._ignored)

    def _ignore(self, key: str, why: str) -> None:
        if key not in self._junk:
            _log.warning("%s: skipped: %s", key, why)
        self._junk[key] = None
        while len(self._junk) > _JUNK_KEPT:
            del self._junk[next(iter(self._junk))]
        self._ignored[key] = why
        while len(self._ignored) > _IGNORED_SHOWN:
            del self._ignored[next(iter(self._ignored))]

    @property
    def stats(self) -> StoreStats:
        return StoreStats(
            bytes_up=self._bytes_up, bytes_down=self._bytes_down, requests=dict(self._requests)
        )

    def __repr__(self) -> str:
        return (
            f"Store({self.mailbox!r}, up={self._bytes_up}, down={self._bytes_down}, "
            f"requests={self._requests})"
        )

    # -- raw, counted, retried operations -------------------------------------------------

    async def _retry(self, op: Callable[[], Awaitable[T]], attempts: int | None) -> T:
        return await retrying(
            op,
            clock=self._clock,
            max_delay=self._max_delay,
            attempts=attempts if attempts is not None else self._attempts,
        )

    async def get(
        self, key: str, *, attempts: int | None = None, max_bytes: int | None = None
    ) -> bytes | None:
        """The bytes under ``key`` or None; ``ObjectRefused`` (a ``RecordError``) for an
        object over ``max_bytes`` or one the mailbox will not read, before its body is read."""

        async def op() -> bytes | None:
            self._requests["get"] += 1
            data = await self.mailbox.get(key, max_bytes=max_bytes)
            if data is not None:
                self._bytes_down += len(data)
            return data

        return await self._retry(op, attempts)

    async def _object(
        self, key: str, *, limit: int = MAX_RECORD_BYTES, attempts: int | None = None
    ) -> bytes | None:
        """The bytes of the object at ``key`` (manifest, claim, marker, beat, snapshot or
        record), or None. One the mailbox refuses unread (over ``limit``, or not a regular
        file) is junk: it comes back as empty bytes, which fail to decode, so every walk
        skips it as it skips any malformed object."""
        try:
            return await self.get(key, attempts=attempts, max_bytes=limit)
        except ObjectRefused as exc:
            self._ignore(key, str(exc))
            return b""

    async def list_keys(
        self, prefix: str, *, after: str = "", attempts: int | None = None
    ) -> Sequence[str]:
        """Every key under ``prefix`` after ``after``, in byte order."""

        async def op() -> Sequence[str]:
            self._requests["list"] += 1
            return await self.mailbox.list(prefix, after=after)

        return await self._retry(op, attempts)

    async def delete(self, keys_: Iterable[str], *, attempts: int | None = None) -> None:
        """Remove ``keys_`` (missing ones are fine)."""
        batch = list(keys_)
        if not batch:
            return

        async def op() -> None:
            self._requests["delete"] += 1
            await self.mailbox.delete(batch)

        await self._retry(op, attempts)

    async def create(
        self, key: str, data: bytes, *, attempts: int | None = None, read_back: bool = True
    ) -> bool:
        """Create ``key`` holding ``data``; True iff the object now there is this write's.

        When a try failed transiently (its object may have landed) and a later try finds the
        key taken, the object is read back (unless ``read_back`` is False): equal bytes mean
        the lost try created it.
        """
        ambiguous = False

        async def op() -> bool:
            nonlocal ambiguous
            self._requests["put"] += 1
            try:
                created = await self.mailbox.put_if_absent(key, data)
            except MailboxUnavailable:
                ambiguous = True
                raise
            if created:
                self._bytes_up += len(data)
            return created

        if await self._retry(op, attempts):
            return True
        if not ambiguous or not read_back:
            return False
        return await self.get(key, attempts=attempts) == data

    # -- signing ---------------------------------------------------------------------------

    def _run_of(self, key: str) -> str:
        """The run id ``key``'s signature covers: none before the run exists (creation
        claims, Θ⁰ markers) and for the manifest, whose body holds it."""
        if key.startswith((keys.CREATE, keys.INIT, keys.MANIFEST)):
            return ""
        return self._run

    def _learn(self, manifest: Manifest, data: bytes) -> Manifest:
        self._run = manifest.run_id if isinstance(manifest.run_id, str) else ""
        self._history.manifest = sha256(data)
        self._history.checked = not self._unverified or not isinstance(manifest.key_id, str)
        self._fragments = manifest.config.fragments
        if not self._unverified:
            self.signing = self.signing.learn(manifest)
        return manifest

    async def refresh_identities(self, *, now: bool = False) -> bool:
        """In a run with learner identities, fold in the admissions and revocations not yet
        seen (into ``signing``), listing them at most every ``REFRESH_EVERY`` seconds unless
        ``now``; whether any was new."""
        at, before = self._clock.now(), self.signing.identities
        if before is None or not (now or self.signing.due(at)):
            return False
        self.signing = self.signing.listed_at(at)
        for key in await self.list_keys(IDENTITIES):
            if key not in self.signing.seen:
                data = await self._object(key) or b""
                self.signing, why = self.signing.fold(key, data, self._run, at)
                if why is not None:
                    self._ignore(key, why)
        return self.signing.identities != before

    def _signed(self, key: str, obj: S) -> S:
        return self.signing.sign(key, obj, self._run_of(key))

    def _encode(self, key: str, obj: S) -> bytes:
        return encode(self._signed(key, obj))

    def _problem(self, key: str, data: bytes) -> Problem | None:
        """Why ``data`` fails this store's run key (None: it passes, or the run is not
        signed); ``RecordError`` when it is not a bounded JSON object."""
        return self.signing.check(key, data, self._run_of(key))

    def _decode(self, key: str, data: bytes, kind: type[S]) -> S:
        """``data`` read from ``key`` as a ``kind``; ``RecordError`` naming the key."""
        problem = self._problem(key, data)
        if problem is not None:
            raise SignatureError(key, problem)
        try:
            return decode(data, kind)
        except RecordError as exc:
            raise RecordError(f"{key}: {exc}") from exc

    def _claimant(self, key: str, data: bytes, kind: type[CreateClaim] | type[RoundClaim]) -> str:
        """Who holds the claim at ``key``: nobody (``""``) when it is malformed or does not
        verify, so that it is taken over instead of failing its round forever."""
        try:
            return self._decode(key, data, kind).learner
        except RecordError as exc:
            self._ignore(key, f"{exc}; counted as nobody's claim")
            return ""

    # -- blobs ------------------------------------------------------------------------------

    async def put_blob(self, data: bytes, encoding: str, *, indexed: bool = False) -> BlobRef:
        """``_blobs.put_blob``: store ``data`` under its sha256 and return its ref."""
        return await _blobs.put_blob(self, data, encoding, indexed=indexed)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of ``key`` (``RangedMailbox.get_range``), or None; a
        mailbox without ranged reads answers from a whole ``get``. Retried and counted as
        ``get`` is."""

        async def op() -> bytes | None:
            self._requests["get"] += 1
            if isinstance(self.mailbox, RangedMailbox):
                data = await self.mailbox.get_range(key, start, end)
            else:
                whole = await self.mailbox.get(key)
                data = None if whole is None else whole[start:end]
            if data is not None:
                self._bytes_down += len(data)
            return data

        return await self._retry(op, None)

    async def blob_ranges(
        self, ref: BlobRef, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes] | None:
        """``_blobs.blob_ranges``: ranges of ``ref``, each checked; None when it is gone."""
        return await _blobs.blob_ranges(self, ref, ranges)

    async def get_blob(self, ref: BlobRef, *, most: int | None = None) -> bytes | None:
        """``_blobs.get_blob``: the bytes of ``ref``, read no further than ``ref.size`` (at
        most ``most``) and verified; None when the blob is gone. Raises ``CorruptBlob``."""
        return await _blobs.get_blob(self, ref, most=most)

    async def delta_blobs(self, snapshot: Snapshot) -> list[bytes] | None:
        """``_blobs.delta_blobs``: every blob of ``snapshot``'s delta; None when one is gone."""
        return await _blobs.delta_blobs(self, snapshot)

    # -- the manifest and creation ----------------------------------------------------------

    async def manifest(self) -> Manifest | None:
        """The run's manifest: the first of ``keys.manifest_slot`` that decodes (and, in a
        signed run, verifies); None before the run exists.

        Raises ``RunMismatch`` when the run is signed and this store has no key (unless
        ``unverified``), or the other way round, or with another key: a well-formed manifest
        of another kind of run is not skipped, since it may be a real run at this prefix.
        """
        for slot in range(keys.SLOTS):
            key = keys.manifest_slot(slot)
            data = await self._object(key, limit=MAX_MANIFEST_BYTES)
            if data is None:
                return None
            manifest = self._manifest_at(key, data)
            if manifest is not None:
                return self._learn(manifest, data)
        raise RecordError(f"every one of the {keys.SLOTS} manifest keys holds junk")

    def _manifest_at(self, key: str, data: bytes) -> Manifest | None:
        """The manifest in ``data``, or None (remembered) when it is junk."""
        if key in self._junk:
            return None
        try:
            manifest = decode(data, Manifest)
        except RecordError as exc:
            self._ignore(key, str(exc))
            return None
        if not self._unverified:
            check_manifest(manifest, self._run_key)
        problem = None
        if self._run_key is not None:
            problem = self._run_key.check(key, data)
        if problem is not None:
            self._ignore(key, str(SignatureError(key, problem)))
            return None
        return manifest

    async def create_manifest(self, manifest: Manifest) -> Manifest:
        """Write ``manifest`` (with a fresh random ``run_id`` unless it has one) at the first
        manifest key not taken by junk, unless the run has a manifest; return the run's
        manifest (ours or the winner's of a race)."""
        if not isinstance(manifest.run_id, str):
            manifest = msgspec.structs.replace(manifest, run_id=secrets.token_hex(16))
        for slot in range(keys.SLOTS):
            key = keys.manifest_slot(slot)
            signed = self._signed(key, manifest)
            if await self.create(key, ours := encode(signed)):
                return self._learn(signed, ours)
            data = await self._object(key, limit=MAX_MANIFEST_BYTES)
            if data is None:
                raise MailboxUnavailable(f"{key} was reported present but cannot be read")
            winner = self._manifest_at(key, data)
            if winner is not None:
                return self._learn(winner, data)
        raise RecordError(f"every one of the {keys.SLOTS} manifest keys holds junk")

    async def create_claims(self) -> list[tuple[int, str]]:
        """``(attempt, claimant)`` of the creation claims numbered from 0 without a gap, in
        order (a claim after a gap is foreign); a claim that is malformed or does not verify
        under the run key names nobody (``""``)."""
        attempts = _from_zero(
            keys.parse_create_claim(key) for key in await self.list_keys(keys.CREATE)
        )
        claims = []
        for attempt in attempts:
            key = keys.create_claim(attempt)
            data = await self._object(key)
            if data is None:
                break
            claims.append((attempt, self._claimant(key, data, CreateClaim)))
        return claims

    async def claim_creation(self, attempt: int, learner: str) -> bool:
        """Take creation claim ``attempt``; ``RecordError`` when the layout has no such
        claim (every one before it was taken: the store is flooded)."""
        _check_claim(attempt, "the run's creation")
        key = keys.create_claim(attempt)
        return await self.create(key, self._encode(key, CreateClaim(learner=learner)))

    async def put_init_marker(self, attempt: int, marker: InitMarker) -> None:
        key = keys.init_marker(attempt, marker.fragment)
        await self.create(key, self._encode(key, marker))

    async def init_markers(self, attempt: int) -> list[str]:
        """The keys of ``attempt``'s Θ⁰ markers; in a signed run only those that verify, as
        a forged marker is no sign of a creator's progress."""
        found = [
            key
            for key in await self.list_keys(keys.init_prefix(attempt))
            if keys.parse_init_marker(key) is not None
        ]
        if self._run_key is None:
            return found
        verified = []
        for key in found:
            data = await self._object(key)
            try:
                if data is not None and self._problem(key, data) is None:
                    verified.append(key)
            except RecordError:
                continue
        return verified

    # -- leases ------------------------------------------------------------------------------

    async def beat(self, learner: str, beat: int, role: keys.Role) -> bool:
        key = keys.lease(learner, beat, role)
        return await self.create(key, self._encode(key, LeaseBeat(learner=learner)))

    async def own_beats(
        self, learner: str, *, attempts: int | None = None
    ) -> list[tuple[int, str]]:
        """The beats of ``learner``'s lease present, as ``(beat, key)``, oldest first: those
        whose body is a beat of ``learner`` (and, in a signed run, verifies), so that beats
        planted under its name neither make it look dead nor push its next beat out of the
        layout."""
        beats = []
        for key in await self.list_keys(keys.lease_prefix(learner), attempts=attempts):
            parsed = keys.parse_lease(key)
            if parsed is not None and await self._beat_ok(key, learner, attempts):
                beats.append((parsed[1], key))
        return sorted(beats)

    async def leases(self) -> dict[str, tuple[int, keys.Role]]:
        """Every node holding a lease, with its newest good beat (one whose body is a beat
        of that node and, in a signed run, verifies) and that beat's role."""
        await self.refresh_identities()
        listed: dict[str, list[tuple[int, keys.Role, str]]] = {}
        for key in await self.list_keys(keys.LEASES):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                learner, beat, role = parsed
                listed.setdefault(learner, []).append((beat, role, key))
        newest: dict[str, tuple[int, keys.Role]] = {}
        for learner, beats in listed.items():
            for beat, role, key in sorted(beats, reverse=True):
                if await self._beat_ok(key, learner, None):
                    newest[learner] = (beat, role)
                    break
        present = {key for beats in listed.values() for _, _, key in beats}
        self._beats = {key: ok for key, ok in self._beats.items() if key in present}
        return newest

    async def _beat_ok(self, key: str, learner: str, attempts: int | None) -> bool:
        """Whether ``key`` holds a beat of ``learner`` (verified in a signed run); each
        verdict is remembered, as beats are create-once."""
        known = self._beats.get(key)
        if known is not None:
            return known
        data = await self._object(key, attempts=attempts)
        if data is None:
            return False
        try:
            ok = self._decode(key, data, LeaseBeat).learner == learner
        except RecordError as exc:
            self._ignore(key, str(exc))
            ok = False
        self._beats[key] = ok
        return ok

    async def lease_beats(self) -> dict[str, dict[int, keys.Role]]:
        """Every node's lease beats present, as ``{beat: role}``: only beats whose body is a
        beat of their node and, in a signed run, verifies under the run key and the run's id
        (each beat is read once and remembered), so a beat someone else planted under a
        node's lease is ignored."""
        await self.refresh_identities()
        listed = [
            (key, parsed)
            for key in await self.list_keys(keys.LEASES)
            if (parsed := keys.parse_lease(key)) is not None
        ]
        found: dict[str, dict[int, keys.Role]] = {}
        for key, (node, beat, role) in listed:
            if await self._beat_ok(key, node, None):
                found.setdefault(node, {})[beat] = role
        present = {key for key, _ in listed}
        self._beats = {key: ok for key, ok in self._beats.items() if key in present}
        return found

    # -- snapshots, claims, records -----------------------------------------------------------

    async def put_snapshot(self, snapshot: Snapshot) -> bool:
        """Publish ``snapshot`` at the first of its keys (``keys.snapshot_slot``) not taken by
        junk or (signed run) by an unverified object; False when a good snapshot of this
        learner already holds the round (an earlier run of this learner id, or in an unsigned
        run a forgery)."""
        for slot in range(keys.SLOTS):
            key = keys.snapshot_slot(snapshot.round, snapshot.learner, slot)
            if await self.create(key, self._encode(key, snapshot)):
                return True
            data = await self._object(key)
            if data is None:
                raise MailboxUnavailable(f"{key} reported present but unreadable")
            found = self._snapshot_at(key, snapshot.round, snapshot.learner, data)
            if found is not None and found[1] is None:
                return False
        raise RecordError(
            f"every key of {snapshot.learner}'s snapshot of round {snapshot.round} is junk"
        )

    def _snapshot_at(
        self, key: str, round: int, learner: str, data: bytes
    ) -> tuple[Snapshot, Problem | None] | None:
        """The snapshot in ``data`` with its problem under the run key, or None (remembered)
        when it is junk: malformed, misfiled, or in a signed run unverified at a successor
        key. A well-formed unverified one at the first key is kept, for the round to reject
        with its reason; the learner's own snapshot then goes to a successor."""
        if key in self._junk:
            return None
        try:
            snapshot = decode(data, Snapshot)
        except RecordError as exc:
            self._ignore(key, f"{exc}")
            return None
        if snapshot.round != round or snapshot.learner != learner:
            self._ignore(key, f"it is not {learner}'s snapshot of round {round}")
            return None
        problem = self._problem(key, data)
        if problem is not None and key != keys.snapshot(round, learner):
            self._ignore(key, str(SignatureError(key, problem)))
            return None
        return snapshot, problem

    async def _listed_snapshots(self, round: int) -> dict[str, list[str]]:
        """``learner -> its snapshot keys of round``, in slot order, from one listing."""
        found: dict[str, list[tuple[int, str]]] = {}
        for key in await self.list_keys(keys.snapshots_prefix(round)):
            parsed = keys.parse_snapshot_slot(key)
            if parsed is not None and parsed[0] == round:
                found.setdefault(parsed[1], []).append((parsed[2], key))
        return {learner: [key for _, key in sorted(slots)] for learner, slots in found.items()}

    async def _snapshot_of(
        self, round: int, learner: str, listed: Sequence[str]
    ) -> tuple[Snapshot, Problem | None] | None:
        """``learner``'s snapshot of ``round``: the first verified one among its keys (in a
        signed run), else the first well-formed one (with its problem); None when none is."""
        fallback = None
        cache = self._snapshots.setdefault(round, {})
        for key in listed:
            known = cache.get(key)
            if known is None:
                data = await self._object(key)
                if data is None:
                    continue
                known = self._snapshot_at(key, round, learner, data)
                # A learner admitted since the last look is looked up once more, not refused.
                if (
                    known is not None
                    and known[1] == "not-admitted"
                    and await self.refresh_identities(now=True)
                ):
                    known = self._snapshot_at(key, round, learner, data)
                if known is None:
                    continue
                cache[key] = known
            if known[1] is None:
                return known
            fallback = fallback or known
        return fallback

    async def snapshot_learners(self, round: int) -> list[str]:
        """The learners with a snapshot in ``round`` that counts: one that decodes, names its
        key's round and learner and, in a signed run, verifies (each body read once)."""
        await self.refresh_identities()
        for stale in [r for r in self._snapshots if r < round - _CLAIM_CACHE_ROUNDS]:
            del self._snapshots[stale]
        learners = []
        for learner, listed in (await self._listed_snapshots(round)).items():
            found = await self._snapshot_of(round, learner, listed)
            if found is not None and found[1] is None:
                learners.append(learner)
        return learners

    async def snapshots(self, round: int) -> list[tuple[Snapshot, Problem | None]]:
        """Each learner's snapshot of ``round`` (see ``_snapshot_of``), with why it fails the
        run key's check (None when it passes or the run is not signed): the round rejects
        those with that reason. Junk is logged and left out: it must not stop the round."""
        await self.refresh_identities()
        listed = await self._listed_snapshots(round)
        found = []
        for learner in sorted(listed):
            snapshot = await self._snapshot_of(round, learner, listed[learner])
            if snapshot is not None:
                found.append(snapshot)
        return found

    async def round_claims(self, round: int) -> list[tuple[int, str]]:
        """``(k, claimant)`` of the claims on ``round`` numbered from 0 without a gap, in
        order (a claim after a gap is foreign; a malformed or unverified one names nobody).

        Claims are create-once, so each body is read once and remembered (for the rounds
        near the newest asked about): following a round costs one listing per poll.
        """
        for stale in [r for r in self._claimants if r < round - _CLAIM_CACHE_ROUNDS]:
            del self._claimants[stale]
        known = self._claimants.setdefault(round, {})
        listed = []
        for key in await self.list_keys(keys.claims_prefix(round)):
            parsed = keys.parse_claim(key)
            listed.append(parsed[1] if parsed is not None and parsed[0] == round else None)
        claims = []
        for k in _from_zero(listed):
            key = keys.round_claim(round, k)
            if k not in known:
                data = await self._object(key)
                if data is None:
                    continue
                known[k] = self._claimant(key, data, RoundClaim)
            claims.append((k, known[k]))
        return claims

    async def claim_round(self, round: int, k: int, learner: str) -> bool:
        """Take the ``k``-th claim on ``round``; ``RecordError`` when the layout has no such
        claim (every one before it was taken: the store is flooded)."""
        _check_claim(k, f"round {round}")
        key = keys.round_claim(round, k)
        return await self.create(key, self._encode(key, RoundClaim(learner=learner)))

    async def record(
        self, round: int, *, listed: Iterable[str] | None = None
    ) -> RoundRecord | None:
        """The record of ``round``: the first of its keys (``keys.record_slot``) holding a
        record that decodes, verifies (signed run) and describes ``round``; None when the
        walk reaches an empty key first (the round is not committed). ``listed``: the keys
        of the round a listing found, so that no absent key is read (junk is read once).
        ``StoreTampered`` when it does not chain onto the round before (``_history``)."""
        return await self._history.record(
            round, lambda at: self._walk_record(at, listed if at == round else None)
        )

    async def _walk_record(self, round: int, listed: Iterable[str] | None = None) -> Stored | None:
        present = None if listed is None else set(listed)
        for slot in range(keys.SLOTS):
            key = keys.record_slot(round, slot)
            if key in self._junk:
                continue
            data = None if present is not None and key not in present else await self._object(key)
            if data is None:
                return None
            if (record := self._record_at(key, round, data)) is not None:
                return Stored(key, await hashed(data), record)
        return None

    def _record_at(self, key: str, round: int, data: bytes) -> RoundRecord | None:
        """The record in ``data`` read from ``key``, or None (remembered) when it is junk."""
        try:
            record = self._decode(key, data, RoundRecord)
        except RecordError as exc:
            self._ignore(key, str(exc))
            return None
        fragments = self._fragments
        if record.round != round or (
            fragments is not None
            and (
                record.fragment != keys.fragment_of(round, fragments)
                or record.version != keys.version_of(round, fragments)
            )
        ):
            self._ignore(key, f"it does not describe round {round}")
            return None
        return record

    async def put_record(self, record: RoundRecord) -> tuple[RoundRecord, bool]:
        """Commit ``record``, bound to the round before, at the first of its keys not taken by
        junk, unless the round has a record; return the round's record and whether it is this
        write's. ``RecordError``: every key is junk; ``StoreTampered``: ``History.linked``."""
        junk, claims = self._junk, None if self._run_key is None else self.round_claims
        record, before = await self._history.linked(record, self._walk_record, junk, claims)
        for key in (keys.record_slot(record.round, n) for n in range(keys.SLOTS)):
            if key in self._junk:
                continue
            signed = self._signed(key, record)
            if await self.create(key, ours := encode(signed)):
                self._history.check(Stored(key, await hashed(ours), signed), before)
                return signed, True
            if (data := await self._object(key)) is None:
                raise MailboxUnavailable(f"{key} reported present but unreadable")
            if (theirs := self._record_at(key, record.round, data)) is not None:
                self._history.check(Stored(key, await hashed(data), theirs), before)
                return theirs, False
        raise RecordError(f"every one of the {keys.SLOTS} keys of round {record.round} is junk")

    async def record_rounds(self, *, after: int = -1) -> list[int]:
        """The committed rounds after ``after``, in order: the listed rounds that follow
        ``after`` without a gap (rounds commit in order, so one further on is foreign),
        less a tail whose listed keys hold junk only. One listing, and a read of each key
        not judged yet: planted junk costs no reads on later calls."""
        start = keys.record(after) if after >= 0 else ""
        offsets: list[int | None] = []
        listed: dict[int, list[str]] = {}
        for key in await self.list_keys(keys.RECORDS, after=start):
            round = keys.parse_record(key)
            # A successor key of round ``after`` itself lists after ``after``'s first key.
            offsets.append(None if round is None or round <= after else round - after - 1)
            if round is not None:
                listed.setdefault(round, []).append(key)
        rounds = [after + 1 + offset for offset in _from_zero(offsets)]
        while rounds and await self.record(rounds[-1], listed=listed[rounds[-1]]) is None:
            rounds.pop()
        return rounds


def _from_zero(numbers: Iterable[int | None]) -> list[int]:
    """The numbers 0, 1, 2, … as far as ``numbers`` (ascending, repeats and None allowed)
    holds them without a gap."""
    run: list[int] = []
    for number in numbers:
        if number is None or (run and number == run[-1]):
            continue
        if number != len(run):
            break
        run.append(number)
    return run


def _check_claim(k: int, what: str) -> None:
    if k >= keys.SLOTS:
        raise RecordError(
            f"{what} has {keys.SLOTS} claims already: someone is flooding the store; "
            "clean its claims or use another prefix"
        )
