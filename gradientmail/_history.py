"""The round records one store has taken, each checked against the one before it.

``Store`` finds a round's record (the first good one of its keys, ``Records.walk``);
``History`` remembers it with the sha256 of its bytes, checks its link to the record taken
for the round before (``protocol.chain``) before handing it out, and sets the link of every
record the store commits. A link that breaks raises ``StoreTampered`` naming the key that no
longer holds what the history was built on: no reader uses, and no writer commits over, a
history it cannot verify.

Runs on the event loop of the store's node, like the store.
"""

from collections.abc import Awaitable, Callable, Container

import msgspec

from gradientmail.errors import StoreTampered
from gradientmail.protocol import keys
from gradientmail.protocol.chain import Stored, link_problem, overwritten
from gradientmail.protocol.records import RoundRecord

__all__ = ["Claims", "History", "Walk"]

Walk = Callable[[int], Awaitable[Stored | None]]
"""How a store finds the record of a round in the store (None: the round has none)."""
Claims = Callable[[int], Awaitable[list[tuple[int, str]]]]
"""The claims on a round that count, ``(k, claimant)`` (``Store.round_claims``)."""

_KEPT = 1024
"""How many rounds' records (immutable once committed) a history remembers, the newest."""


class History:
    """What one store has taken of a run's history. ``manifest``: the sha256 of the manifest's
    bytes, which round 0 binds (None until the store has read or written it). ``checked``
    False (a signed run, or a run not yet read, read without its key: ``Store``'s
    ``unverified``): links are not checked, since such a reader takes forgeries the run's
    nodes skip."""

    def __init__(self, *, checked: bool = True) -> None:
        self.manifest: str | None = None
        self.checked = checked
        self._taken: dict[int, Stored] = {}
        self._checked: set[int] = set()

    async def record(self, round: int, walk: Walk) -> RoundRecord | None:
        """The record of ``round`` (None: the round has none), its link checked;
        ``StoreTampered`` when it breaks."""
        taken = await self._take(round, walk)
        if taken is None:
            return None
        if round not in self._checked:
            self.check(taken, await self.before(round, walk))
        return taken.record

    async def linked(
        self,
        record: RoundRecord,
        walk: Walk,
        junk: Container[str],
        claims: Claims,
        *,
        verified: bool,
    ) -> tuple[RoundRecord, Stored | None]:
        """``record`` binding the record taken for the round before it (or the manifest), and
        that record. ``StoreTampered`` when that round holds no record that decodes, or when
        the round's first key is in ``junk``, a claim on the next round names its claimant
        (asked only then) and no key of the round holds a record (``chain.overwritten``):
        committing at a successor key would fork. ``verified`` False (an unsigned run, where
        anyone can plant a claim): a claim counts only when its claimant committed a round
        this history took, as a syncer of the run has; a claim naming anyone else proves
        nothing, and the record goes to a successor key. Taking part does not count: a
        well-formed snapshot planted by anyone takes part in an unsigned run."""
        round = record.round
        first_junk = keys.record(round) in junk
        claimed = first_junk and await self._claimed(claims, round + 1, verified=verified)
        # Read after the claim: a record its claimant took is in the store by then.
        held = claimed and await self._take(round, walk) is not None
        if (found := overwritten(round, first_junk, claimed, held)) is not None:
            raise StoreTampered(found.key, found.why)
        before = await self.before(round, walk)
        previous = self.manifest if before is None else before.digest
        linked = record if previous is None else msgspec.structs.replace(record, previous=previous)
        problem = link_problem(Stored(keys.record(round), "", linked), before, self.manifest)
        if problem is not None:
            raise StoreTampered(problem.key, problem.why)
        return linked, before

    async def _claimed(self, claims: Claims, round: int, *, verified: bool) -> bool:
        """Whether a claim on ``round`` names its claimant (one that committed a round this
        history took, unless ``verified``)."""
        named = {claimant for _, claimant in await claims(round) if claimant}
        if verified or not named:
            return bool(named)
        return not named.isdisjoint(stored.record.committed_by for stored in self._taken.values())

    def check(self, taken: Stored, before: Stored | None) -> None:
        """Remember ``taken`` once it chains onto ``before``; ``StoreTampered`` otherwise."""
        problem = link_problem(taken, before, self.manifest) if self.checked else None
        if problem is not None:
            raise StoreTampered(problem.key, problem.why)
        self._remember(taken)
        self._checked.add(taken.record.round)

    async def before(self, round: int, walk: Walk) -> Stored | None:
        """The record taken for the round before ``round`` (None for round 0, or when that
        round has none)."""
        return None if round == 0 else await self._take(round - 1, walk)

    async def _take(self, round: int, walk: Walk) -> Stored | None:
        known = self._taken.get(round)
        if known is None:
            known = await walk(round)
            if known is not None:
                self._remember(known)
        return known

    def _remember(self, taken: Stored) -> None:
        self._taken[taken.record.round] = taken
        while len(self._taken) > _KEPT:
            oldest = min(self._taken)
            del self._taken[oldest]
            self._checked.discard(oldest)
