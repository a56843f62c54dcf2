"""A syncer's cadence: when the next round's first snapshot is expected, from the first
snapshots of the rounds before it, and whether recent rounds' snapshots landed over several
due pauses (loose), which sets the pace a synchronous round is polled at."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.cadence import ANTICIPATION, Cadence
from gradientmail.protocol.records import RunConfig
from gradientmail.protocol.rounds import RoundObservation, RoundState, Wait, observed


def test_a_steady_pace_makes_the_next_round_due_before_its_first_snapshot() -> None:
    cadence = Cadence().seen(3, 10.0).seen(4, 14.0).seen(5, 18.0)
    assert cadence.due_from(6) == 18.0 + ANTICIPATION * 4.0
    assert 18.0 < cadence.due_from(6) < 22.0  # type: ignore[operator]
    assert cadence.expected_at(6) == 22.0
    assert Cadence().seen(3, 10.0).expected_at(4) is None


def test_nothing_is_expected_without_two_consecutive_rounds_ending_just_before() -> None:
    assert Cadence().due_from(0) is None
    assert Cadence().seen(3, 10.0).due_from(4) is None
    assert Cadence().seen(3, 10.0).seen(5, 18.0).due_from(6) is None  # 4 was not seen
    assert Cadence().seen(3, 10.0).seen(4, 14.0).due_from(6) is None  # 5 was not seen
    # A round this syncer listed nothing in (another closed it first) leaves the cadence.
    assert Cadence().seen(3, 10.0).seen(4, None) == Cadence().seen(3, 10.0)


def test_one_late_round_does_not_move_the_expectation() -> None:
    cadence = Cadence()
    for round, at in enumerate([0.0, 4.0, 8.0, 12.0, 40.0, 44.0]):
        cadence = cadence.seen(round, at)
    assert cadence.due_from(6) == 44.0 + ANTICIPATION * 4.0


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(0.0, 1e4, allow_nan=False)),
        min_size=1,
        max_size=40,
    )
)
def test_the_expectation_is_after_the_last_first_snapshot_and_bounded(
    steps: list[tuple[int, float]],
) -> None:
    """Whatever rounds were seen and when: a cadence keeps few of them, and a round it
    expects is due after the first snapshot of the round before it, within the longest
    interval it kept."""
    cadence, round, at = Cadence(), 0, 0.0
    for skip, gap in steps:
        round, at = round + 1 + skip, at + gap
        cadence = cadence.seen(round, at)
        assert len(cadence.firsts) <= 8
        due = cadence.due_from(round + 1)
        if due is None:
            continue
        spans = [b - a for (_, a), (_, b) in zip(cadence.firsts, cadence.firsts[1:], strict=False)]
        assert at <= due <= at + max(spans)


def test_rounds_whose_snapshots_landed_over_several_pauses_are_loose() -> None:
    cadence = Cadence()
    assert not cadence.loose(0.05)
    for round, spread in enumerate([0.4, 0.02, 0.5, 0.3]):
        cadence = cadence.seen(round, 10.0 * round, 10.0 * round + spread)
    assert cadence.spreads == pytest.approx((0.4, 0.02, 0.5, 0.3))
    assert cadence.loose(0.05)
    assert not cadence.loose(0.2)  # a median of 0.35 s is under two pauses of 0.2 s
    # A round another syncer closed adds its first snapshot, not a spread.
    assert cadence.seen(4, 40.0).spreads == cadence.spreads
    # One slow round among tight ones does not make them loose.
    tight = Cadence()
    for round, spread in enumerate([0.01, 0.02, 3.0, 0.01, 0.03]):
        tight = tight.seen(round, 10.0 * round, 10.0 * round + spread)
    assert not tight.loose(0.05)
    assert len(tight.seen(9, 90.0, 90.1).spreads) <= 8


LEARNERS = frozenset({"a", "b", "c"})
SYNCHRONOUS = RunConfig(quorum_fraction=1.0, grace=2.0, overlap=0)


def _look(published: frozenset[str]) -> RoundObservation:
    return RoundObservation(None, (), published, LEARNERS, LEARNERS, 0.0, 0.0)


def test_a_loose_synchronous_round_is_polled_at_the_wait_pace_once_one_can_complete_it() -> None:
    """Every learner waits on the last snapshot: the looks before it need not be fast."""
    loose = RoundState(7, "a", claim_timeout=30.0, loose=True).claimed(0.0)
    tight = replace(loose, loose=False)
    one, two = frozenset({"a"}), frozenset({"a", "b"})
    assert observed(loose, _look(one), 0.1, SYNCHRONOUS)[1] == Wait(due=True)
    assert observed(loose, _look(two), 0.1, SYNCHRONOUS)[1] == Wait(due=True, waited_on=True)
    assert observed(tight, _look(one), 0.1, SYNCHRONOUS)[1] == Wait(due=True, waited_on=True)
    # Before its first snapshot, past the expected time of it: the due pace, unless one
    # learner alone is waited for.
    expected = replace(loose, due_from=10.0, expected_at=10.5)
    assert observed(expected, _look(frozenset()), 10.6, SYNCHRONOUS)[1] == Wait(due=True)
    alone = RoundObservation(None, (), frozenset(), frozenset({"a"}), frozenset({"a"}), 0.0, 0.0)
    assert observed(expected, alone, 10.6, SYNCHRONOUS)[1] == Wait(due=True, waited_on=True)
    tight_expected = replace(expected, loose=False)
    waited = Wait(due=True, waited_on=True)
    assert observed(tight_expected, _look(frozenset()), 10.6, SYNCHRONOUS)[1] == waited


@given(st.sets(st.sampled_from(sorted(LEARNERS))), st.booleans(), st.sampled_from([0, 2, None]))
def test_the_wait_pace_needs_a_waited_on_round_and_if_loose_one_missing_learner(
    published: set[str], loose: bool, overlap: int | None
) -> None:
    config = RunConfig(quorum_fraction=1.0, grace=2.0, overlap=overlap)
    state = RoundState(7, "a", claim_timeout=30.0, loose=loose).claimed(0.0)
    _, step = observed(state, _look(frozenset(published)), 0.1, config)
    if published == LEARNERS:
        assert not isinstance(step, Wait)
        return
    assert isinstance(step, Wait)
    missing = len(LEARNERS - published)
    synchronous = overlap == 0 and bool(published)
    assert step.waited_on == (synchronous and (not loose or missing <= 1))
