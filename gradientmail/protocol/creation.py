"""Creating a run as a pure state machine: what a node does next while the run has no manifest.

A node entering a run without a manifest holds a ``CreationState`` and feeds it one
``CreationView`` after another (what one look at ``create/`` showed). ``decide_creation(state,
view, now)`` answers ``(state', action)``; the node's shell (``_node/run_creation.py``) only lists,
claims, uploads and sleeps as ``action`` says:

- no claim: ``ClaimCreation(0)`` (a node that cannot create, a syncer-only one,
  ``WaitForCreation``\\ s);
- the last claim is this node's (a restart): ``Create`` the run as that attempt;
- another node's claim is the last: ``Count`` its init markers (``announce``: this node has
  just begun waiting for that claimant), then, fed the count, ``WaitForCreation`` while markers keep
  landing, and ``TakeOverCreation`` (the next claim) once no marker has landed for ``timeout``
  seconds on this node's clock, or at once when the claim names nobody (malformed, or
  unverified in a signed run: there is no creator to wait for).

Only the claims numbered contiguously from 0 count (``rounds.counted_claims``): one planted after a
gap is ignored. When every claim number is taken (only a hostile writer takes them all) a
node that takes over creates without a claim (``TakeOverCreation.claim`` False): the manifest is
create-once, so racing creators still make one run.

Pure: no I/O, no clock; the caller passes ``now``.
"""

from dataclasses import dataclass, replace
from typing import TypeAlias

from gradientmail.protocol.rounds import MAX_CLAIMS, counted_claims

__all__ = [
    "ClaimCreation",
    "Count",
    "Create",
    "CreationAction",
    "CreationState",
    "CreationView",
    "TakeOverCreation",
    "WaitForCreation",
    "decide_creation",
]


@dataclass(frozen=True, slots=True)
class CreationState:
    """One node's wait for a run's creator: this node (``me``), whether it can create the
    run (it has a model), the creation timeout in seconds, the claim it watches
    (``(k, claimant)``; None: none yet), the init markers it last counted there (-1: not
    counted yet) and since when that count has held (``since``)."""

    me: str
    can_create: bool
    timeout: float
    watching: tuple[int, str] | None = None
    markers: int = -1
    since: float = 0.0


@dataclass(frozen=True, slots=True)
class CreationView:
    """One look at ``create/``: every claim listed (``(k, claimant)``, any order), and the
    number of init markers under the last counted claim (None: not listed in this look)."""

    claims: tuple[tuple[int, str], ...]
    markers: int | None = None


@dataclass(frozen=True, slots=True)
class ClaimCreation:
    """Nobody claimed creation: take claim ``k`` (0) and create as attempt ``k`` if won."""

    k: int


@dataclass(frozen=True, slots=True)
class Create:
    """The last claim is this node's: create the run as ``attempt``."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Count:
    """Count the init markers under claim ``k`` and decide again with the count.
    ``announce``: the claimants, in order, when this node has just begun waiting for the
    last (the shell reports it); None otherwise."""

    k: int
    announce: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class TakeOverCreation:
    """The creator of the last claim failed: take claim ``k`` and create as attempt ``k``
    (``claim`` False: every claim number is taken, create as ``k`` without a claim).
    ``waited``: seconds since the last progress this node saw."""

    k: int
    waited: float
    claim: bool = True


@dataclass(frozen=True, slots=True)
class WaitForCreation:
    """Nothing to do now: look again after the poll interval."""


CreationAction: TypeAlias = ClaimCreation | Create | Count | TakeOverCreation | WaitForCreation


def decide_creation(
    state: CreationState, view: CreationView, now: float
) -> tuple[CreationState, CreationAction]:
    """The next state and action of a node entering a run without a manifest, after
    ``view`` taken at ``now`` (see the module docstring)."""
    claims = counted_claims(view.claims)
    if not claims:
        return state, ClaimCreation(0) if state.can_create else WaitForCreation()
    last, claimant = claims[-1]
    if claimant == state.me and state.can_create:
        return state, Create(last)
    announce = None
    if state.watching != (last, claimant):
        state = replace(state, watching=(last, claimant), markers=-1, since=now)
        announce = tuple(c for _, c in claims)
    if view.markers is None:
        return state, Count(last, announce)
    if view.markers != state.markers and claimant:
        return replace(state, markers=view.markers, since=now), WaitForCreation()
    if state.can_create and (not claimant or now - state.since >= state.timeout):
        waited = now - state.since
        if last + 1 >= MAX_CLAIMS:
            return state, TakeOverCreation(last, waited, claim=False)
        return state, TakeOverCreation(last + 1, waited)
    return state, WaitForCreation()
