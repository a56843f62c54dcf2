"""Creating a run as a pure state machine (``protocol.creation``): who claims, who creates,
who waits and when a waiter takes over, without I/O."""

from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.creation import (
    ClaimCreation,
    Count,
    Create,
    CreationAction,
    CreationState,
    CreationView,
    TakeOverCreation,
    WaitForCreation,
    decide_creation,
)
from gradientmail.protocol.rounds import MAX_CLAIMS

TIMEOUT = 30.0
LEARNER = CreationState("a", can_create=True, timeout=TIMEOUT)
SYNCER = CreationState("a", can_create=False, timeout=TIMEOUT)


def look(
    state: CreationState, claims: tuple[tuple[int, str], ...], markers: int, now: float
) -> tuple[CreationState, CreationAction, Count | None]:
    """One look as the node's shell takes it: the claims, then the markers when asked."""
    view = CreationView(claims)
    state, action = decide_creation(state, view, now)
    if not isinstance(action, Count):
        return state, action, None
    state, second = decide_creation(state, CreationView(claims, markers), now)
    return state, second, action


def test_nobody_claimed_a_learner_claims_and_a_syncer_waits() -> None:
    assert decide_creation(LEARNER, CreationView(()), 0.0)[1] == ClaimCreation(0)
    assert decide_creation(SYNCER, CreationView(()), 0.0)[1] == WaitForCreation()


def test_our_own_last_claim_is_created_but_not_by_a_node_without_a_model() -> None:
    claims = ((0, "b"), (1, "a"))
    assert decide_creation(LEARNER, CreationView(claims), 0.0)[1] == Create(1)
    assert decide_creation(SYNCER, CreationView(claims), 0.0)[1] == Count(1, ("b", "a"))


def test_a_waiter_announces_once_and_waits_while_markers_land() -> None:
    claims = ((0, "b"),)
    state, action, counted = look(LEARNER, claims, 0, 0.0)
    assert (counted, action) == (Count(0, ("b",)), WaitForCreation())
    for step in range(1, 5):
        now = step * TIMEOUT * 0.9
        state, action, counted = look(state, claims, step, now)
        assert (counted, action) == (Count(0, None), WaitForCreation())
    assert state.since == 4 * TIMEOUT * 0.9


def test_no_marker_for_the_timeout_takes_the_next_claim() -> None:
    claims = ((0, "b"),)
    state, _, _ = look(LEARNER, claims, 2, 10.0)
    state, action, _ = look(state, claims, 2, 10.0 + TIMEOUT - 0.1)
    assert action == WaitForCreation()
    _, action, _ = look(state, claims, 2, 10.0 + TIMEOUT)
    assert action == TakeOverCreation(1, TIMEOUT)


def test_a_claim_naming_nobody_is_taken_over_at_once() -> None:
    _, action, counted = look(LEARNER, ((0, ""),), 3, 5.0)
    assert counted == Count(0, ("",))
    assert action == TakeOverCreation(1, 0.0)


def test_a_node_without_a_model_never_takes_over() -> None:
    state, _, _ = look(SYNCER, ((0, ""),), 0, 0.0)
    _, action, _ = look(state, ((0, ""),), 0, 10 * TIMEOUT)
    assert action == WaitForCreation()


def test_a_claim_after_a_gap_is_ignored() -> None:
    claims = ((0, "b"), (7, "a"), (MAX_CLAIMS - 1, "a"))
    state, _, counted = look(LEARNER, claims, 0, 0.0)
    assert counted == Count(0, ("b",))
    assert state.watching == (0, "b")


def test_when_every_claim_number_is_taken_the_waiter_creates_without_one() -> None:
    claims = tuple((k, "b") for k in range(MAX_CLAIMS))
    state, _, _ = look(LEARNER, claims, 1, 0.0)
    _, action, _ = look(state, claims, 1, TIMEOUT)
    assert action == TakeOverCreation(MAX_CLAIMS - 1, TIMEOUT, claim=False)


PLANTED = 1000
"""Claims at or above this number are planted after a gap; honest ones stay below it."""


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[float, tuple[tuple[int, str], ...], int]]:
    """Looks at ``create/``: the time, the claims listed, the markers of the last claim."""
    honest: list[tuple[int, str]] = []
    planted: list[tuple[int, str]] = []
    markers, now = 0, 0.0
    looks = []
    for _ in range(draw(st.integers(1, 30))):
        now += draw(st.sampled_from([0.0, 1.0, 10.0, TIMEOUT - 1.0, TIMEOUT]))
        move = draw(st.sampled_from(["same", "same", "marker", "claim", "plant"]))
        if move == "marker":
            markers += 1
        elif move == "claim":
            honest.append((len(honest), draw(st.sampled_from(["a", "b", "c", ""]))))
            markers = 0
        elif move == "plant":
            planted.append((PLANTED + len(planted), "b"))
        looks.append((now, tuple(honest + planted), markers))
    return looks


@given(scripts(), st.booleans())
def test_a_waiter_takes_over_exactly_when_its_creator_stalled(
    script: list[tuple[float, tuple[tuple[int, str], ...], int]], can_create: bool
) -> None:
    """Against the history of the looks: a node takes over the last honest claim exactly
    when it can create and the claim names nobody, or the marker count it listed has not
    changed for the timeout; a node that cannot create only ever counts and waits; a claim
    after a gap is never watched; the claimants are announced once per claim watched."""
    state = CreationState("a", can_create=can_create, timeout=TIMEOUT)
    seen: list[tuple[float, int]] = []
    watched: tuple[int, str] | None = None
    for now, claims, markers in script:
        honest = [claim for claim in claims if claim[0] < PLANTED]
        state, action, counted = look(state, claims, markers, now)
        if not can_create:
            assert isinstance(action, WaitForCreation)
        if not honest:
            assert action == (ClaimCreation(0) if can_create else WaitForCreation())
            continue
        last, claimant = honest[-1]
        if claimant == "a" and can_create:
            assert action == Create(last)
            continue
        assert counted is not None
        assert counted.k == last
        announce = tuple(c for _, c in honest) if watched != (last, claimant) else None
        assert counted.announce == announce
        if watched != (last, claimant):
            watched, seen = (last, claimant), []
        seen.append((now, markers))
        start = len(seen) - 1
        while start > 0 and seen[start - 1][1] == markers:
            start -= 1
        stalled_since = seen[start][0] if claimant else seen[0][0]
        if can_create and (not claimant or now - stalled_since >= TIMEOUT):
            assert action == TakeOverCreation(last + 1, now - stalled_since)
        else:
            assert action == WaitForCreation()
