"""The learner's pure parts: the in-place merge and the state's transitions."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gradientmail._node.learner import FragmentState, LearnerState, Ready, merge_in_place
from gradientmail.protocol import keys
from gradientmail.protocol.merge import Ledger, merged
from gradientmail.protocol.records import BlobRef, Participant, Rejection, RoundRecord


@pytest.mark.parametrize("outcome", ["included", "late", "rejected"])
@pytest.mark.parametrize("rule", ["keep-progress", "alpha"])
def test_the_in_place_merge_is_merged_bit_for_bit(outcome: str, rule: str) -> None:
    generator = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (5,), (3, 2, 2)]

    def tensors() -> list[torch.Tensor]:
        return [torch.randn(shape, generator=generator) * 1e3 for shape in shapes]

    local, theta, snapshot, base = tensors(), tensors(), tensors(), tensors()
    expected = merged(
        outcome,  # type: ignore[arg-type]
        local=local,
        theta=theta,
        snapshot=snapshot,
        base=base,
        rule=rule,  # type: ignore[arg-type]
        alpha=0.3,
    )
    params = [t.clone() for t in local]
    merge_in_place(
        params,
        outcome,  # type: ignore[arg-type]
        theta=theta,
        snapshot=snapshot,
        base=base,
        rule=rule,  # type: ignore[arg-type]
        alpha=0.3,
    )
    for got, want in zip(params, expected, strict=True):
        assert torch.equal(got, want)


REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


def record(
    round: int, *, included: tuple[str, ...] = (), rejected: tuple[str, ...] = ()
) -> RoundRecord:
    return RoundRecord(
        round=round,
        fragment=round % 2,
        version=round // 2 + 1,
        committed_by="s",
        participants=tuple(
            Participant(learner=name, weight=1.0, steps=1, tokens=1, base_version=0)
            for name in included
        ),
        rejected=tuple(
            Rejection(learner=name, reason="outlier", steps=1, tokens=1) for name in rejected
        ),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        theta=REF,
        outer=REF,
        update=REF,
    )


def fresh() -> LearnerState:
    base = (torch.zeros(2),)
    return LearnerState(
        ledger=Ledger.start(2),
        step=0,
        tokens=0,
        fragments=(FragmentState(version=0, base=base), FragmentState(version=0, base=base)),
        newest_round=-1,
    )


def test_a_snapshot_targets_the_round_after_its_base_and_blocks_until_aligned() -> None:
    state = fresh().stepped(10).stepped(10)
    state, round = state.published(1, (torch.ones(2),))
    assert round == 1
    assert state.fragments[1].blocked
    assert not state.fragments[0].blocked
    state = state.publish_done(1, 1, ok=True)
    assert state.fragments[1].blocked  # published, its round not yet applied
    state, events = state.recorded(record(0), "me")
    assert not events
    state, events = state.recorded(record(1, included=("me",)), "me")
    assert not events
    assert state.fragments[1].published is not None
    assert state.fragments[1].published.outcome == "included"
    assert state.ledger[1].committed.steps == 2
    assert state.fragments[1].wanted is not None


def test_a_rejected_snapshot_reports_and_drops_its_steps() -> None:
    state = fresh().stepped(5)
    state, _ = state.published(0, (torch.ones(2),))
    state = state.stepped(5)
    state, events = state.recorded(record(0, rejected=("me",)), "me")
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["SnapshotRejected", "StepsDropped"]
    assert state.ledger[0].dropped.steps == 2
    assert state.ledger[0].balanced


def test_a_failed_publish_releases_the_fragment_and_keeps_its_steps() -> None:
    state = fresh().stepped(5)
    state, _ = state.published(0, (torch.ones(2),))
    state = state.publish_done(0, 0, ok=False)
    assert not state.fragments[0].blocked
    assert state.ledger[0].since_base.steps == 1
    assert state.ledger[0].in_flight is None


class LearnerMachine(RuleBasedStateMachine):
    """Random interleavings of steps, publishes, publish outcomes, committed rounds and
    applied versions, as the node's tasks drive them: the ledger stays balanced, a
    fragment holds at most one unresolved snapshot, and every snapshot targets the round
    after its base."""

    fragments = 2

    def __init__(self) -> None:
        super().__init__()
        self.state = fresh()
        self.next_round = 0

    @rule(tokens=st.integers(min_value=0, max_value=9))
    def step(self, tokens: int) -> None:
        self.state = self.state.stepped(tokens)

    @rule(fragment=st.integers(min_value=0, max_value=1))
    def publish(self, fragment: int) -> None:
        entry = self.state.fragments[fragment]
        if entry.blocked or self.state.ledger[fragment].since_base.steps == 0:
            return
        self.state, round = self.state.published(fragment, (torch.ones(2),))
        assert round == keys.round_of(fragment, entry.version + 1, self.fragments)

    @rule(fragment=st.integers(min_value=0, max_value=1), ok=st.booleans())
    def publish_done(self, fragment: int, ok: bool) -> None:
        entry = self.state.fragments[fragment]
        if entry.in_flight and entry.published is not None:
            self.state = self.state.publish_done(fragment, entry.published.round, ok)

    @rule(outcome=st.sampled_from(["included", "rejected", "absent"]))
    def commit(self, outcome: str) -> None:
        round = self.next_round
        self.next_round += 1
        names = {"included": ("me",), "rejected": (), "absent": ()}[outcome]
        rejected = ("me",) if outcome == "rejected" else ()
        entry = self.state.fragments[round % self.fragments]
        mine = entry.published is not None and entry.published.round == round
        self.state, events = self.state.recorded(
            record(round, included=names if mine else (), rejected=rejected if mine else ()),
            "me",
        )
        assert all(e.learner == "me" for e in events)

    @rule(fragment=st.integers(min_value=0, max_value=1))
    def download(self, fragment: int) -> None:
        entry = self.state.fragments[fragment]
        if entry.wanted is not None and entry.ready is None:
            wanted = entry.wanted
            ready = Ready(round=wanted.round, version=wanted.version, theta=(torch.zeros(2),))
            self.state = self.state.prepared(fragment, ready)

    @rule(fragment=st.integers(min_value=0, max_value=1))
    def apply(self, fragment: int) -> None:
        if self.state.fragments[fragment].ready is not None:
            self.state = self.state.aligned(fragment)

    @invariant()
    def balanced(self) -> None:
        for fragment in range(self.fragments):
            ledger = self.state.ledger[fragment]
            assert ledger.balanced
            assert ledger.total.steps == self.state.step
            entry = self.state.fragments[fragment]
            flight = ledger.in_flight
            unresolved = entry.published is not None and entry.published.outcome is None
            assert (flight is not None) == unresolved
            if flight is not None and entry.published is not None:
                assert flight.round == entry.published.round


TestLearnerMachine = LearnerMachine.TestCase
TestLearnerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
