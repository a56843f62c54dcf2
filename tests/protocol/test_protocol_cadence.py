"""A syncer's cadence: when the next round's first snapshot is expected, from the first
snapshots of the rounds before it."""

from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.cadence import ANTICIPATION, Cadence


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
