"""Learner liveness: a lease per node, renewed by beats and judged on the observer's clock.

A node's lease is the set of create-once beat objects under ``leases/{node}/``
(``protocol.keys``). The node writes a new beat every ``lease_every`` seconds while it runs
(deleting the one before) and deletes its beats when it closes. An observer lists the leases
and remembers, per node, the set of beats it saw and the moment on its own clock when that
set last changed: a node is live while its set of beats has changed within
``lease_timeout`` seconds, and gone the moment its last beat leaves the listing. No wall
clock crosses machines, so a lease written by a node with a skewed clock reads like any
other; the cost is that an observer trusts a lease it has just met for one timeout before
doubting it.

Judging by the set rather than by the highest beat number means a beat someone else
planted under a node's prefix, whatever its number, does not freeze that node's lease: the
node's own beats keep changing the set. (In a signed run beats that do not verify are left
out of the listing altogether, ``Store.lease_beats``; in an unsigned run a planted beat can
still keep a dead node's lease looking live while the planter keeps changing it, or set the
role a node is first seen with.) A node's role is that of the newest beat that appeared
since the previous listing (on first sight: of its highest beat).

Pure: no I/O, no clock reads; the caller passes ``now``.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gradientmail.protocol.keys import Role, trains

__all__ = ["LeaseWatch", "Liveness"]


def _beats(value: int | frozenset[int]) -> frozenset[int]:
    return frozenset((value,)) if isinstance(value, int) else value


@dataclass(frozen=True, slots=True)
class Liveness:
    """Which nodes hold a live lease, as one observer has seen it.

    ``seen`` maps a node to the beats of its lease and when this observer first saw that
    set of beats.
    """

    timeout: float
    seen: Mapping[str, tuple[frozenset[int], float]] = field(default_factory=dict)

    def observed(self, leases: Mapping[str, int | frozenset[int]], now: float) -> "Liveness":
        """Fold one listing of the leases (node -> its beats, or its newest beat), taken
        at ``now``."""

        def since(learner: str, beats: frozenset[int]) -> float:
            known = self.seen.get(learner)
            return known[1] if known is not None and known[0] == beats else now

        folded = {learner: _beats(value) for learner, value in leases.items()}
        return replace(
            self,
            seen={learner: (beats, since(learner, beats)) for learner, beats in folded.items()},
        )

    def live(self, now: float) -> frozenset[str]:
        """The nodes whose beats have changed within ``timeout`` seconds of ``now``."""
        return frozenset(
            learner for learner, (_, since) in self.seen.items() if now - since < self.timeout
        )

    def is_live(self, learner: str, now: float) -> bool:
        """Whether ``learner``'s beats have changed within ``timeout`` seconds of ``now``."""
        known = self.seen.get(learner)
        return known is not None and now - known[1] < self.timeout


@dataclass(frozen=True, slots=True)
class LeaseWatch:
    """A syncer's running view of the leases: who is live, and whose lease says it trains.

    The leases are listed at most every ``every`` seconds (``due``): a lease changes once
    per beat, and listing it on every poll would multiply a follower's requests for nothing.
    ``looked`` is when the last listing was taken (None: never).
    """

    liveness: Liveness
    every: float
    roles: Mapping[str, Role] = field(default_factory=dict)
    looked: float | None = None

    @property
    def learners(self) -> frozenset[str]:
        """The nodes whose lease says ``learner`` or ``closing``."""
        return frozenset(node for node, role in self.roles.items() if trains(role))

    @property
    def closing(self) -> frozenset[str]:
        """The nodes whose lease says ``closing``: learners that began closing."""
        return frozenset(node for node, role in self.roles.items() if role == "closing")

    def due(self, now: float) -> bool:
        """Whether a listing taken at ``now`` is due."""
        return self.looked is None or now - self.looked >= self.every

    def observed(self, beats: Mapping[str, Mapping[int, Role]], now: float) -> "LeaseWatch":
        """Fold one listing of every node's beats (``{beat: role}``) taken at ``now``."""
        roles: dict[str, Role] = {}
        for node, found in beats.items():
            if not found:
                continue
            known = self.liveness.seen.get(node)
            new = [beat for beat in found if known is None or beat not in known[0]]
            if new or node not in self.roles:
                roles[node] = found[max(new or found)]
            else:
                roles[node] = self.roles[node]
        liveness = self.liveness.observed(
            {node: frozenset(found) for node, found in beats.items() if found}, now
        )
        return replace(self, liveness=liveness, roles=roles, looked=now)

    def live(self, now: float) -> frozenset[str]:
        """The nodes holding a live lease at ``now``."""
        return self.liveness.live(now)
