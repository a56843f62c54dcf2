"""Round records, the commit points: each round's at the first good one of its keys
(``keys.record_slot``), checked against the record taken for the round before
(``_history``).

A record that does not decode, does not verify (signed run) or does not describe its key's
round is junk: readers and writers alike move on to the key's next successor, so the first
good record in that order is the round's, for every honest node. Rounds commit in order, so
a listed round after a gap is foreign.

Runs in the node's tasks on the event loop, like the store; the sha256 of each record's
bytes is taken in a worker thread when they are large.
"""

from collections.abc import Iterable

from gradientmail._history import History
from gradientmail.errors import MailboxUnavailable, RecordError
from gradientmail.protocol import keys
from gradientmail.protocol.chain import Stored
from gradientmail.protocol.records import RoundRecord, encode
from gradientmail.store._blobs import hashed
from gradientmail.store._claims import RoundClaims, from_zero
from gradientmail.store._objects import RunObjects

__all__ = ["Records"]


class Records:
    """The round records of the run in ``objects``, taken into ``history``; ``claims``
    gives the evidence that a round was committed over (``History.linked``)."""

    def __init__(self, objects: RunObjects, history: History, claims: RoundClaims) -> None:
        self._objects = objects
        self._history = history
        self._claims = claims

    async def record(
        self, round: int, *, listed: Iterable[str] | None = None
    ) -> RoundRecord | None:
        """The record of ``round``: the first of its keys (``keys.record_slot``) holding a
        record that decodes, verifies (signed run) and describes ``round``; None when the
        walk reaches an empty key first (the round is not committed). ``listed``: the keys
        of the round a listing found, so that no absent key is read (junk is read once).
        ``StoreTampered`` when it does not chain onto the round before (``_history``)."""
        return await self._history.record(
            round, lambda at: self.walk(at, listed if at == round else None)
        )

    async def walk(self, round: int, listed: Iterable[str] | None = None) -> Stored | None:
        """The first good record among ``round``'s keys with the sha256 of its bytes; None
        when an empty key (or one not in ``listed``) comes first."""
        present = None if listed is None else set(listed)
        for slot in range(keys.SLOTS):
            key = keys.record_slot(round, slot)
            if key in self._objects.junk:
                continue
            absent = present is not None and key not in present
            data = None if absent else await self._objects.read(key)
            if data is None:
                return None
            if (record := self._record_at(key, round, data)) is not None:
                return Stored(key, await hashed(data), record)
        return None

    def _record_at(self, key: str, round: int, data: bytes) -> RoundRecord | None:
        """The record in ``data`` read from ``key``, or None (remembered) when it is junk."""
        try:
            record = self._objects.decode(key, data, RoundRecord)
        except RecordError as exc:
            self._objects.ignore(key, str(exc))
            return None
        fragments = self._objects.fragments
        if record.round != round or (
            fragments is not None
            and (
                record.fragment != keys.fragment_of(round, fragments)
                or record.version != keys.version_of(round, fragments)
            )
        ):
            self._objects.ignore(key, f"it does not describe round {round}")
            return None
        return record

    async def put_record(self, record: RoundRecord) -> tuple[RoundRecord, bool]:
        """Commit ``record``, bound to the round before, at the first of its keys not taken by
        junk, unless the round has a record; return the round's record and whether it is this
        write's. ``RecordError``: every key is junk; ``StoreTampered``: ``History.linked``."""
        objects = self._objects
        record, before = await self._history.linked(
            record,
            self.walk,
            objects.junk,
            self._claims.round_claims,
            verified=objects.run_key is not None,
        )
        for key in (keys.record_slot(record.round, n) for n in range(keys.SLOTS)):
            if key in objects.junk:
                continue
            signed = objects.signed(key, record)
            if await objects.requests.create(key, ours := encode(signed)):
                self._history.check(Stored(key, await hashed(ours), signed), before)
                return signed, True
            if (data := await objects.read(key)) is None:
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
        for key in await self._objects.requests.list_keys(keys.RECORDS, after=start):
            round = keys.parse_record(key)
            # A successor key of round ``after`` itself lists after ``after``'s first key.
            offsets.append(None if round is None or round <= after else round - after - 1)
            if round is not None:
                listed.setdefault(round, []).append(key)
        rounds = [after + 1 + offset for offset in from_zero(offsets)]
        while rounds and await self.record(rounds[-1], listed=listed[rounds[-1]]) is None:
            rounds.pop()
        return rounds
