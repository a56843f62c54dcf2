"""The typed layer over a mailbox: the only place that turns a run's bytes into records.

``Store`` wraps one ``Mailbox`` for one node. Every operation

- retries ``MailboxUnavailable`` with backoff (``mailbox.retrying``) on the node's clock, up
  to ``max_retry_delay`` between tries, forever unless the call says otherwise; every other
  error propagates at once;
- decodes what it reads strictly (``RecordError`` for a malformed object) and verifies every
  blob against its sha256 (``CorruptBlob``);
- counts the requests it makes by kind and the bytes it moves, for ``Store.stats``.

Create-once writes whose reply may have been lost are settled here, once: a
``put_if_absent`` that failed transiently and whose retry then finds the key taken reads the
object back, and the write counts as ours when the bytes are ours (claims and records name
their writer, so equal bytes cannot be someone else's).

Runs in the node's tasks on the event loop; hashing of large payloads goes to a worker
thread (``anyio.to_thread``). Cancellation interrupts the request in progress; a cancelled
create-once write may or may not have landed (the caller's next read tells).
"""

import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import anyio
import anyio.to_thread

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import CorruptBlob, MailboxUnavailable, RecordError
from gradientmail.mailbox import Mailbox, retrying
from gradientmail.protocol import keys
from gradientmail.protocol.records import (
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

__all__ = ["Store", "StoreStats", "gather", "sha256"]

_log = logging.getLogger("gradientmail.store")

T = TypeVar("T")
S = TypeVar("S", bound=_Object)

_HASH_INLINE_BYTES = 1 << 16
"""Payloads up to this size are hashed on the event loop; larger ones in a worker thread."""


def sha256(data: bytes) -> str:
    """The lowercase hex sha256 of ``data``: the name of its blob."""
    return hashlib.sha256(data).hexdigest()


async def _hash(data: bytes) -> str:
    if len(data) <= _HASH_INLINE_BYTES:
        return sha256(data)
    return await anyio.to_thread.run_sync(sha256, data)


_CLAIM_CACHE_ROUNDS = 64
"""How many rounds behind the newest asked about a claim body stays remembered."""


async def gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``calls`` concurrently (one task each) and return their results in order.

    When some fail, the first failure (in completion order) is raised on its own, as a
    sequential caller would see it, unless a cancellation is among them; the other calls
    are cancelled.
    """
    results: dict[int, T] = {}

    async def one(index: int, call: Callable[[], Awaitable[T]]) -> None:
        results[index] = await call()

    try:
        async with anyio.create_task_group() as tg:
            for index, call in enumerate(calls):
                tg.start_soon(one, index, call)
    except BaseExceptionGroup as group:
        errors = group.exceptions
        if all(isinstance(error, Exception) for error in errors):
            raise errors[0] from None
        raise
    return [results[index] for index in range(len(calls))]


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
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        clock: Clock | None = None,
        max_retry_delay: float = 30.0,
        attempts: int | None = None,
        run_key: RunKey | None = None,
    ) -> None:
        self.mailbox = mailbox
        self._run_key = run_key
        self._clock = clock if clock is not None else MonotonicClock()
        self._max_delay = max_retry_delay
        self._attempts = attempts
        self._bytes_up = 0
        self._bytes_down = 0
        self._requests = {"put": 0, "get": 0, "list": 0, "delete": 0}
        self._claimants: dict[int, dict[int, str]] = {}
        self._beats_verified: dict[str, bool] = {}

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

    async def get(self, key: str, *, attempts: int | None = None) -> bytes | None:
        """The bytes under ``key`` or None."""

        async def op() -> bytes | None:
            self._requests["get"] += 1
            data = await self.mailbox.get(key)
            if data is not None:
                self._bytes_down += len(data)
            return data

        return await self._retry(op, attempts)

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

    # -- signing ----------------------------------------------------------------------------

    def _signed(self, key: str, obj: S) -> S:
        return obj if self._run_key is None else self._run_key.sign(key, obj)

    def _encode(self, key: str, obj: S) -> bytes:
        return encode(self._signed(key, obj))

    def _decode(self, key: str, data: bytes, kind: type[S]) -> S:
        """``data`` read from ``key`` as a ``kind``; ``RecordError`` naming the key."""
        if self._run_key is not None:
            self._run_key.verify(key, data)
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
            _log.warning("%s; counting it as nobody's claim", exc)
            return ""

    # -- blobs ------------------------------------------------------------------------------

    async def put_blob(self, data: bytes, encoding: str) -> BlobRef:
        """Store ``data`` under its sha256 (a no-op when it is there) and return its ref."""
        digest = await _hash(data)
        # Content-addressed: whoever wrote the key wrote these bytes; nothing to read back.
        await self.create(keys.blob(digest), data, read_back=False)
        return BlobRef(sha256=digest, size=len(data), encoding=encoding)

    async def get_blob(self, ref: BlobRef) -> bytes | None:
        """The bytes of ``ref``, verified; None when the blob is gone (collected).

        Raises ``CorruptBlob`` when the bytes do not hash to ``ref.sha256``.
        """
        data = await self.get(keys.blob(ref.sha256))
        if data is None:
            return None
        digest = await _hash(data)
        if digest != ref.sha256 or len(data) != ref.size:
            raise CorruptBlob(
                f"blob {ref.sha256[:16]}… holds {len(data)} bytes hashing to {digest[:16]}…; "
                "the store's copy is damaged"
            )
        return data

    # -- the manifest and creation ----------------------------------------------------------

    async def manifest(self) -> Manifest | None:
        """The run's manifest, or None before the run exists.

        Raises ``RunMismatch`` when the run is signed and this store has no key, or the other
        way round, or with another key; ``SignatureError`` when a signed manifest does not
        verify under this store's key.
        """
        data = await self.get(keys.MANIFEST)
        if data is None:
            return None
        try:
            manifest = decode(data, Manifest)
        except RecordError as exc:
            raise RecordError(f"{keys.MANIFEST}: {exc}") from exc
        check_manifest(manifest, self._run_key)
        if self._run_key is not None:
            self._run_key.verify(keys.MANIFEST, data)
        return manifest

    async def create_manifest(self, manifest: Manifest) -> Manifest:
        """Write ``manifest`` unless one exists; return the run's manifest (ours or the
        winner's of a race)."""
        signed = self._signed(keys.MANIFEST, manifest)
        if await self.create(keys.MANIFEST, encode(signed)):
            return signed
        winner = await self.manifest()
        if winner is None:
            raise MailboxUnavailable("the manifest was reported present but cannot be read")
        return winner

    async def create_claims(self) -> list[tuple[int, str]]:
        """``(attempt, claimant)`` of the creation claims in attempt order; a claim that
        does not verify under the run key names nobody (``""``)."""
        claims = []
        for key in await self.list_keys(keys.CREATE):
            attempt = keys.parse_create_claim(key)
            data = None if attempt is None else await self.get(key)
            if attempt is not None and data is not None:
                claims.append((attempt, self._claimant(key, data, CreateClaim)))
        return claims

    async def claim_creation(self, attempt: int, learner: str) -> bool:
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
            data = await self.get(key)
            try:
                if data is not None and self._run_key.check(key, data) is None:
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
        """The beats of ``learner``'s lease present, as ``(beat, key)``, oldest first."""
        beats = []
        for key in await self.list_keys(keys.lease_prefix(learner), attempts=attempts):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                beats.append((parsed[1], key))
        return sorted(beats)

    async def leases(self) -> dict[str, tuple[int, keys.Role]]:
        """Every node holding a lease, with its newest beat and that beat's role."""
        newest: dict[str, tuple[int, keys.Role]] = {}
        for key in await self.list_keys(keys.LEASES):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                learner, beat, role = parsed
                if beat > newest.get(learner, (-1, role))[0]:
                    newest[learner] = (beat, role)
        return newest

    async def lease_beats(self) -> dict[str, dict[int, keys.Role]]:
        """Every node's lease beats present, as ``{beat: role}``. In a signed run only beats
        that verify under the run key are listed (each beat is read once and remembered), so
        a beat someone else planted under a node's lease is ignored."""
        listed = [
            (key, parsed)
            for key in await self.list_keys(keys.LEASES)
            if (parsed := keys.parse_lease(key)) is not None
        ]
        if self._run_key is not None:
            known = {key: self._beats_verified.get(key) for key, _ in listed}
            for key, verified in known.items():
                if verified is None:
                    data = await self.get(key)
                    known[key] = data is not None and self._verifies(key, data)
            self._beats_verified = {key: bool(ok) for key, ok in known.items()}
        found: dict[str, dict[int, keys.Role]] = {}
        for key, (node, beat, role) in listed:
            if self._run_key is None or self._beats_verified.get(key):
                found.setdefault(node, {})[beat] = role
        return found

    def _verifies(self, key: str, data: bytes) -> bool:
        assert self._run_key is not None
        try:
            return self._run_key.check(key, data) is None
        except RecordError:
            return False

    # -- snapshots, claims, records -----------------------------------------------------------

    async def put_snapshot(self, snapshot: Snapshot) -> bool:
        key = keys.snapshot(snapshot.round, snapshot.learner)
        return await self.create(key, self._encode(key, snapshot))

    async def snapshot_learners(self, round: int) -> list[str]:
        """The learners with a snapshot in ``round`` (a listing; no bodies read)."""
        learners = []
        for key in await self.list_keys(keys.snapshots_prefix(round)):
            parsed = keys.parse_snapshot(key)
            if parsed is not None and parsed[0] == round:
                learners.append(parsed[1])
        return learners

    async def snapshots(self, round: int) -> list[tuple[Snapshot, Problem | None]]:
        """The snapshots of ``round`` that decode and name their key's round and learner,
        each with why it fails the run key's check (None when it passes or the run is not
        signed): the round rejects those with that reason.

        A malformed one is logged and left out: it cannot take part, and it must not stop the
        round.
        """
        learners = await self.snapshot_learners(round)
        bodies = await gather(
            [partial(self.get, keys.snapshot(round, learner)) for learner in learners]
        )
        found = []
        for learner, data in zip(learners, bodies, strict=True):
            if data is None:
                continue
            try:
                snapshot = decode(data, Snapshot)
            except Exception as exc:
                _log.warning("round %d: ignoring %s's malformed snapshot: %s", round, learner, exc)
                continue
            if snapshot.round != round or snapshot.learner != learner:
                _log.warning("round %d: ignoring %s's misfiled snapshot", round, learner)
                continue
            key = keys.snapshot(round, learner)
            problem = None if self._run_key is None else self._run_key.check(key, data)
            found.append((snapshot, problem))
        return found

    async def round_claims(self, round: int) -> list[tuple[int, str]]:
        """``(k, claimant)`` of every claim on ``round``, in order.

        Claims are create-once, so each body is read once and remembered (for the rounds
        near the newest asked about): following a round costs one listing per poll.
        """
        for stale in [r for r in self._claimants if r < round - _CLAIM_CACHE_ROUNDS]:
            del self._claimants[stale]
        known = self._claimants.setdefault(round, {})
        claims = []
        for key in await self.list_keys(keys.claims_prefix(round)):
            parsed = keys.parse_claim(key)
            if parsed is None or parsed[0] != round:
                continue
            k = parsed[1]
            if k not in known:
                data = await self.get(key)
                if data is None:
                    continue
                known[k] = self._claimant(key, data, RoundClaim)
            claims.append((k, known[k]))
        return claims

    async def claim_round(self, round: int, k: int, learner: str) -> bool:
        key = keys.round_claim(round, k)
        return await self.create(key, self._encode(key, RoundClaim(learner=learner)))

    async def record(self, round: int) -> RoundRecord | None:
        """The record of ``round`` or None. ``SignatureError`` (a ``RecordError``) when it
        does not verify under the run key: nobody may follow it."""
        key = keys.record(round)
        data = await self.get(key)
        return None if data is None else self._decode(key, data, RoundRecord)

    async def put_record(self, record: RoundRecord) -> tuple[RoundRecord, bool]:
        """Commit ``record`` unless the round has one; return the round's record (signed,
        in a signed run) and whether it is this write's."""
        key = keys.record(record.round)
        signed = self._signed(key, record)
        if await self.create(key, encode(signed)):
            return signed, True
        theirs = await self.record(record.round)
        if theirs is None:
            raise MailboxUnavailable(f"record {record.round} reported present but unreadable")
        return theirs, False

    async def record_rounds(self, *, after: int = -1) -> list[int]:
        """The rounds with a record, after ``after``, in order."""
        start = keys.record(after) if after >= 0 else ""
        rounds = []
        for key in await self.list_keys(keys.RECORDS, after=start):
            round = keys.parse_record(key)
            if round is not None:
                rounds.append(round)
        return rounds
