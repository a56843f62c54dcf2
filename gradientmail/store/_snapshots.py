"""The learners' snapshots of a round, each at the first good one of its keys
(``keys.snapshot_slot``).

A snapshot that does not decode or is misfiled (another round's or learner's) is junk and
skipped for its key's successor. In a signed run an unverified one at a successor key is
junk too; one at the first key is kept with its problem, for the round to reject with its
reason, and the learner's own snapshot goes to a successor. Snapshots are create-once, so
each body is read once and remembered (for the rounds near the newest asked about).

Runs in the node's tasks on the event loop, like the store.
"""

from collections.abc import Sequence

from gradientmail.errors import MailboxUnavailable, RecordError, SignatureError
from gradientmail.protocol import keys
from gradientmail.protocol.records import Snapshot, decode
from gradientmail.protocol.signing import Problem
from gradientmail.store._objects import CACHED_ROUNDS, RunObjects

__all__ = ["Snapshots"]

Found = tuple[Snapshot, Problem | None]
"""A snapshot with why it fails the run key's check (None: it passes, or the run is not
signed)."""


class Snapshots:
    """The snapshots of the run in ``objects``."""

    def __init__(self, objects: RunObjects) -> None:
        self._objects = objects
        self._found: dict[int, dict[str, Found]] = {}

    async def put_snapshot(self, snapshot: Snapshot) -> bool:
        """Publish ``snapshot`` at the first of its keys (``keys.snapshot_slot``) not taken by
        junk or (signed run) by an unverified object; False when a good snapshot of this
        learner already holds the round (an earlier run of this learner id, or in an unsigned
        run a forgery)."""
        objects = self._objects
        for slot in range(keys.SLOTS):
            key = keys.snapshot_slot(snapshot.round, snapshot.learner, slot)
            if await objects.requests.create(key, objects.encode(key, snapshot)):
                return True
            data = await objects.read(key)
            if data is None:
                raise MailboxUnavailable(f"{key} reported present but unreadable")
            found = self._snapshot_at(key, snapshot.round, snapshot.learner, data)
            if found is not None and found[1] is None:
                return False
        raise RecordError(
            f"every key of {snapshot.learner}'s snapshot of round {snapshot.round} is junk"
        )

    async def snapshot_learners(self, round: int) -> list[str]:
        """The learners with a snapshot in ``round`` that counts: one that decodes, names its
        key's round and learner and, in a signed run, verifies (each body read once)."""
        await self._objects.refresh_identities()
        self._forget_before(round)
        return await self._counted(round, await self._listed(round))

    async def learners_by_round(self, first: int, last: int) -> dict[int, list[str]]:
        """``snapshot_learners`` of each round from ``first`` to ``last`` that has any, from
        one listing (``keys.rounds_span``): a round and those learners may have run on to."""
        await self._objects.refresh_identities()
        self._forget_before(first)
        listed = await self._listing(*keys.rounds_span(first, last))
        found = {}
        for round in range(first, last + 1):
            learners = await self._counted(round, listed.get(round, {}))
            if learners:
                found[round] = learners
        return found

    def _forget_before(self, round: int) -> None:
        for stale in [r for r in self._found if r < round - CACHED_ROUNDS]:
            del self._found[stale]

    async def _counted(self, round: int, listed: dict[str, list[str]]) -> list[str]:
        learners = []
        for learner, keys_ in listed.items():
            found = await self._snapshot_of(round, learner, keys_)
            if found is not None and found[1] is None:
                learners.append(learner)
        return learners

    async def snapshots(self, round: int) -> list[Found]:
        """Each learner's snapshot of ``round`` (see ``_snapshot_of``), with why it fails the
        run key's check (None when it passes or the run is not signed): the round rejects
        those with that reason. Junk is logged and left out: it must not stop the round."""
        await self._objects.refresh_identities()
        listed = await self._listed(round)
        found = []
        for learner in sorted(listed):
            snapshot = await self._snapshot_of(round, learner, listed[learner])
            if snapshot is not None:
                found.append(snapshot)
        return found

    def _snapshot_at(self, key: str, round: int, learner: str, data: bytes) -> Found | None:
        """The snapshot in ``data`` with its problem under the run key, or None (remembered)
        when it is junk: malformed, misfiled, or in a signed run unverified at a successor
        key. A well-formed unverified one at the first key is kept, for the round to reject
        with its reason; the learner's own snapshot then goes to a successor."""
        objects = self._objects
        if key in objects.junk:
            return None
        try:
            snapshot = decode(data, Snapshot)
        except RecordError as exc:
            objects.ignore(key, f"{exc}")
            return None
        if snapshot.round != round or snapshot.learner != learner:
            objects.ignore(key, f"it is not {learner}'s snapshot of round {round}")
            return None
        problem = objects.problem(key, data)
        if problem is not None and key != keys.snapshot(round, learner):
            objects.ignore(key, str(SignatureError(key, problem)))
            return None
        return snapshot, problem

    async def _listed(self, round: int) -> dict[str, list[str]]:
        """``learner -> its snapshot keys of round``, in slot order, from one listing."""
        return (await self._listing(keys.snapshots_prefix(round))).get(round, {})

    async def _listing(self, prefix: str, after: str = "") -> dict[int, dict[str, list[str]]]:
        """``round -> learner -> its snapshot keys``, in slot order, of the snapshot keys
        that one listing of ``prefix`` after ``after`` returns."""
        found: dict[int, dict[str, list[tuple[int, str]]]] = {}
        for key in await self._objects.requests.list_keys(prefix, after=after):
            parsed = keys.parse_snapshot_slot(key)
            if parsed is not None:
                round, learner, slot = parsed
                found.setdefault(round, {}).setdefault(learner, []).append((slot, key))
        return {
            round: {learner: [key for _, key in sorted(slots)] for learner, slots in by.items()}
            for round, by in found.items()
        }

    async def _snapshot_of(self, round: int, learner: str, listed: Sequence[str]) -> Found | None:
        """``learner``'s snapshot of ``round``: the first verified one among its keys (in a
        signed run), else the first well-formed one (with its problem); None when none is."""
        fallback = None
        cache = self._found.setdefault(round, {})
        for key in listed:
            known = cache.get(key)
            if known is None:
                data = await self._objects.read(key)
                if data is None:
                    continue
                known = self._snapshot_at(key, round, learner, data)
                # A learner admitted since the last look is looked up once more, not refused.
                if (
                    known is not None
                    and known[1] == "not-admitted"
                    and await self._objects.refresh_identities(now=True)
                ):
                    known = self._snapshot_at(key, round, learner, data)
                if known is None:
                    continue
                cache[key] = known
            if known[1] is None:
                return known
            fallback = fallback or known
        return fallback
