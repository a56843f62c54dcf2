"""Liveness is a pure value: folding listings and judging leases on the observer's clock."""

from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.liveness import LeaseWatch, Liveness


def test_a_new_lease_is_trusted_for_one_timeout() -> None:
    liveness = Liveness(timeout=10.0).observed({"a": 3}, now=100.0)
    assert liveness.live(109.9) == {"a"}
    assert liveness.live(110.0) == frozenset()


def test_a_changed_beat_renews_and_an_unchanged_one_does_not() -> None:
    liveness = Liveness(timeout=10.0).observed({"a": 1, "b": 1}, now=0.0)
    liveness = liveness.observed({"a": 2, "b": 1}, now=8.0)
    assert liveness.live(12.0) == {"a"}
    assert liveness.is_live("a", 17.9)
    assert not liveness.is_live("b", 12.0)


def test_a_lease_that_leaves_the_listing_is_gone_at_once() -> None:
    liveness = Liveness(timeout=10.0).observed({"a": 1, "b": 1}, now=0.0)
    liveness = liveness.observed({"b": 1}, now=1.0)
    assert liveness.live(1.0) == {"b"}
    assert not liveness.is_live("a", 1.0)


@given(
    st.lists(
        st.dictionaries(st.sampled_from("abcd"), st.integers(0, 5), max_size=4),
        min_size=1,
        max_size=20,
    )
)
def test_live_is_exactly_the_learners_whose_beat_changed_within_the_timeout(
    listings: list[dict[str, int]],
) -> None:
    liveness = Liveness(timeout=3.0)
    history: list[dict[str, int]] = []
    for now, listing in enumerate(listings):
        liveness = liveness.observed(listing, now=float(now))
        history.append(listing)
    now = float(len(listings) - 1)
    expected = set()
    for learner, beat in history[-1].items():
        first = len(history) - 1
        while first > 0 and history[first - 1].get(learner) == beat:
            first -= 1
        if now - first < 3.0:
            expected.add(learner)
    assert liveness.live(now) == expected


def test_a_learner_that_begins_closing_stays_a_learner_and_is_known_as_closing() -> None:
    """b's newest beat says ``closing``: it still counts as a learner, and it is closing; a
    syncer-only node is neither."""
    watch = LeaseWatch(Liveness(timeout=10.0), every=0.0)
    watch = watch.observed({"a": {1: "learner"}, "b": {1: "learner"}, "s": {1: "syncer"}}, 1.0)
    assert (watch.learners, watch.closing) == ({"a", "b"}, frozenset())
    watch = watch.observed({"a": {2: "learner"}, "b": {2: "closing"}, "s": {2: "syncer"}}, 2.0)
    assert (watch.learners, watch.closing) == ({"a", "b"}, {"b"})
