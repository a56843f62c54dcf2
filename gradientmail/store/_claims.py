"""The claims on a round: who takes the ``k``-th try at closing it.

Claims count only in the run of numbers from 0 (``from_zero``): one after a gap is foreign.
A claim that is malformed or, in a signed run, does not verify names nobody (``""``), so that
it is taken over instead of failing its round forever.

Runs in the node's tasks on the event loop, like the store.
"""

from collections.abc import Iterable

from gradientmail.errors import RecordError
from gradientmail.protocol import keys
from gradientmail.protocol.records import RoundClaim
from gradientmail.store._objects import CACHED_ROUNDS, RunObjects

__all__ = ["RoundClaims", "check_claim", "from_zero"]


class RoundClaims:
    """The round claims of the run in ``objects``."""

    def __init__(self, objects: RunObjects) -> None:
        self._objects = objects
        self._claimants: dict[int, dict[int, str]] = {}

    async def round_claims(self, round: int) -> list[tuple[int, str]]:
        """``(k, claimant)`` of the claims on ``round`` numbered from 0 without a gap, in
        order (a claim after a gap is foreign; a malformed or unverified one names nobody).

        Claims are create-once, so each body is read once and remembered (for the rounds
        near the newest asked about): following a round costs one listing per poll.
        """
        for stale in [r for r in self._claimants if r < round - CACHED_ROUNDS]:
            del self._claimants[stale]
        known = self._claimants.setdefault(round, {})
        listed = []
        for key in await self._objects.requests.list_keys(keys.claims_prefix(round)):
            parsed = keys.parse_claim(key)
            listed.append(parsed[1] if parsed is not None and parsed[0] == round else None)
        claims = []
        for k in from_zero(listed):
            key = keys.round_claim(round, k)
            if k not in known:
                data = await self._objects.read(key)
                if data is None:
                    continue
                known[k] = self._objects.claimant(key, data, RoundClaim)
            claims.append((k, known[k]))
        return claims

    async def claim_round(self, round: int, k: int, learner: str) -> bool:
        """Take the ``k``-th claim on ``round``; ``RecordError`` when the layout has no such
        claim (every one before it was taken: the store is flooded)."""
        check_claim(k, f"round {round}")
        key = keys.round_claim(round, k)
        data = self._objects.encode(key, RoundClaim(learner=learner))
        return await self._objects.requests.create(key, data)


def from_zero(numbers: Iterable[int | None]) -> list[int]:
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


def check_claim(k: int, what: str) -> None:
    """``RecordError`` when claim ``k`` of ``what`` is past the layout's ``keys.SLOTS``."""
    if k >= keys.SLOTS:
        raise RecordError(
            f"{what} has {keys.SLOTS} claims already: someone is flooding the store; "
            "clean its claims or use another prefix"
        )
