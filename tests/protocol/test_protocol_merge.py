"""The learner's merge rules, case by case, and the step accounting's invariant."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gradientmail.protocol import keys
from gradientmail.protocol.merge import Ledger, Tally, merge_into, merged
from gradientmail.protocol.records import BlobRef, Participant, Rejection, RoundRecord

ME = "me"
REF = BlobRef(sha256="1" * 64, size=10, encoding="fp32")


def record(
    round: int,
    fragments: int,
    *,
    included: tuple[str, ...] = (),
    rejected: tuple[str, ...] = (),
    steps: int = 1,
    tokens: int = 1,
) -> RoundRecord:
    return RoundRecord(
        round=round,
        fragment=keys.fragment_of(round, fragments),
        version=keys.version_of(round, fragments),
        committed_by="closer",
        participants=tuple(
            Participant(learner=name, weight=1.0, steps=steps, tokens=tokens, base_version=0)
            for name in included
        ),
        rejected=tuple(
            Rejection(learner=name, reason="non-finite", steps=steps, tokens=tokens)
            for name in rejected
        ),
        quorum_seconds=0.5,
        grace_seconds=0.1,
        cosine=None,
        theta=REF,
        outer=REF,
        update=REF,
    )


# -- merge rules ------------------------------------------------------------------------------

THETA = [torch.tensor([10.0, 20.0]), torch.tensor([[1.0]])]
LOCAL = [torch.tensor([3.0, 5.0]), torch.tensor([[7.0]])]
SNAPSHOT = [torch.tensor([2.0, 4.0]), torch.tensor([[6.0]])]
BASE = [torch.tensor([1.0, 1.0]), torch.tensor([[2.0]])]


def merge(
    outcome: str,
    rule: str = "keep-progress",
    alpha: float = 0.5,
    kept: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    return merged(
        outcome,  # type: ignore[arg-type]
        local=LOCAL,
        theta=THETA,
        snapshot=SNAPSHOT,
        base=BASE,
        rule=rule,  # type: ignore[arg-type]
        alpha=alpha,
        kept=kept,
    )


def test_included_keeps_progress_since_the_snapshot() -> None:
    out = merge("included")
    assert torch.equal(out[0], torch.tensor([11.0, 21.0]))
    assert torch.equal(out[1], torch.tensor([[2.0]]))


def test_late_keeps_progress_since_the_base() -> None:
    out = merge("late")
    assert torch.equal(out[0], torch.tensor([12.0, 24.0]))
    assert torch.equal(out[1], torch.tensor([[6.0]]))


def test_rejected_takes_the_global_theta() -> None:
    out = merge("rejected")
    assert all(torch.equal(a, b) for a, b in zip(out, THETA, strict=True))
    out[0].add_(1.0)
    assert torch.equal(THETA[0], torch.tensor([10.0, 20.0]))


@pytest.mark.parametrize("rule", ["keep-progress", "alpha"])
def test_a_final_round_takes_the_global_theta_under_either_rule(rule: str) -> None:
    """A closing learner's final snapshot sent all its weights held beyond θ (under ``topk``
    the residual too), so the final round's merge adds nothing back, ``kept`` included."""
    out = merge("final", rule, alpha=0.25, kept=[torch.ones(2), torch.ones(1, 1)])
    assert all(torch.equal(a, b) for a, b in zip(out, THETA, strict=True))


@pytest.mark.parametrize("outcome", ["included", "late", "rejected"])
def test_alpha_mixes_whatever_the_outcome(outcome: str) -> None:
    out = merge(outcome, rule="alpha", alpha=0.25)
    assert torch.allclose(out[0], torch.tensor([0.25 * 3 + 0.75 * 10, 0.25 * 5 + 0.75 * 20]))
    assert torch.allclose(out[1], torch.tensor([[0.25 * 7 + 0.75 * 1]]))
    assert all(torch.equal(a, b) for a, b in zip(merge(outcome, "alpha", 0.0), THETA, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(merge(outcome, "alpha", 1.0), LOCAL, strict=True))


def test_merge_leaves_its_inputs_alone() -> None:
    before = [[t.clone() for t in ts] for ts in (THETA, LOCAL, SNAPSHOT, BASE)]
    for outcome in ("included", "late", "rejected"):
        merge(outcome)
    after = [THETA, LOCAL, SNAPSHOT, BASE]
    for old, new in zip(before, after, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))


def test_merge_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="needs the snapshot"):
        merged(
            "included",
            local=LOCAL,
            theta=THETA,
            snapshot=None,
            base=BASE,
            rule="keep-progress",
            alpha=0.5,
        )
    with pytest.raises(ValueError, match="needs the base"):
        merged(
            "late",
            local=LOCAL,
            theta=THETA,
            snapshot=SNAPSHOT,
            base=None,
            rule="keep-progress",
            alpha=0.5,
        )
    with pytest.raises(ValueError, match="shape"):
        merged(
            "rejected",
            local=[torch.zeros(3), LOCAL[1]],
            theta=THETA,
            snapshot=None,
            base=None,
            rule="keep-progress",
            alpha=0.5,
        )
    with pytest.raises(ValueError, match="alpha"):
        merge("late", rule="alpha", alpha=1.5)
    with pytest.raises(ValueError, match="merge rule"):
        merge("late", rule="average")
    with pytest.raises(ValueError, match="outcome"):
        merge("lost")


# -- the ledger, case by case -----------------------------------------------------------------


def steps(ledger: Ledger, n: int, tokens: int = 10) -> Ledger:
    for _ in range(n):
        ledger = ledger.stepped(tokens)
    return ledger


@pytest.mark.parametrize("outcome", ["included", "late", "rejected", "final"])
@pytest.mark.parametrize("rule", ["keep-progress", "alpha"])
def test_in_place_merge_is_merged_bit_for_bit(outcome: str, rule: str) -> None:
    """The node merges its live parameters in place with ``merge_into``; ``merged`` is the
    same function on copies, so the two agree bit for bit."""
    generator = torch.Generator().manual_seed(3)

    def tensors() -> list[torch.Tensor]:
        return [torch.randn(shape, generator=generator) * 1e3 for shape in [(7, 5), (5,)]]

    local, theta, snapshot, base, kept = tensors(), tensors(), tensors(), tensors(), tensors()
    kwargs = {"theta": theta, "snapshot": snapshot, "base": base, "alpha": 0.3, "kept": kept}
    expected = merged(outcome, local=local, rule=rule, **kwargs)  # type: ignore[arg-type]
    params = [t.clone() for t in local]
    merge_into(params, outcome, rule=rule, **kwargs)  # type: ignore[arg-type]
    for got, want in zip(params, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("outcome", ["included", "late", "rejected", "final"])
@pytest.mark.parametrize("rule", ["keep-progress", "alpha"])
def test_only_an_included_keep_progress_merge_adds_what_was_kept(outcome: str, rule: str) -> None:
    """``kept`` (a ``topk`` snapshot's unsent residual) goes back into the weights after an
    included merge, and nowhere else: a late merge keeps it already (``θ_local − B``), a
    rejected one drops it with the steps, and ``alpha`` has no reference to add it to."""
    kept = [torch.tensor([0.5, -0.25]), torch.tensor([[0.125]])]
    out = merge(outcome, rule, kept=kept)
    plain = merge(outcome, rule)
    added = outcome == "included" and rule == "keep-progress"
    for got, want, k in zip(out, plain, kept, strict=True):
        assert torch.equal(got, want + k if added else want)


def test_in_place_merge_checks_everything_before_changing_anything() -> None:
    params = [torch.ones(3), torch.ones(2)]
    theta = [torch.zeros(3), torch.zeros(5)]
    with pytest.raises(ValueError, match="tensor 1"):
        merge_into(
            params, "late", theta=theta, snapshot=None, base=theta, rule="keep-progress", alpha=0
        )
    with pytest.raises(ValueError, match="needs the snapshot"):
        merge_into(
            params,
            "included",
            theta=[torch.zeros(3), torch.zeros(2)],
            snapshot=None,
            base=None,
            rule="keep-progress",
            alpha=0,
        )
    with pytest.raises(ValueError, match="kept"):
        merge_into(
            params,
            "included",
            theta=[torch.zeros(3), torch.zeros(2)],
            snapshot=[torch.zeros(3), torch.zeros(2)],
            base=None,
            rule="keep-progress",
            alpha=0,
            kept=[torch.zeros(3)],
        )
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)


def test_included_moves_the_snapshot_and_keeps_the_lag() -> None:
    ledger = steps(Ledger.new(2), 3).published(1, 1)
    ledger = steps(ledger, 2)
    ledger, resolution = ledger.recorded(record(1, 2, included=(ME, "other")), ME)
    assert resolution is not None
    assert resolution.outcome == "included"
    assert (resolution.fragment, resolution.round, resolution.version) == (1, 1, 1)
    assert (resolution.steps, resolution.tokens, resolution.lag) == (3, 30, 2)
    assert resolution.reason is None
    entry = ledger[1]
    assert entry.committed == Tally(3, 30)
    assert entry.since_base == Tally(2, 20)
    assert entry.in_flight is None
    assert entry.balanced
    assert ledger[0].since_base == Tally(5, 50)


def test_rejected_drops_the_snapshot_and_the_lag() -> None:
    ledger = steps(steps(Ledger.new(2), 3).published(0, 2), 2)
    ledger, resolution = ledger.recorded(record(2, 2, rejected=(ME,)), ME)
    assert resolution is not None
    assert resolution.outcome == "rejected"
    assert resolution.reason == "non-finite"
    assert (resolution.steps, resolution.tokens, resolution.lag) == (5, 50, 2)
    assert ledger[0].dropped == Tally(5, 50)
    assert ledger[0].since_base == Tally()
    assert ledger[0].balanced


def test_late_forgets_the_snapshot_and_keeps_the_steps() -> None:
    ledger = steps(steps(Ledger.new(2), 3).published(0, 2), 1)
    after, resolution = ledger.recorded(record(2, 2, included=("other",)), ME)
    assert resolution is not None
    assert resolution.outcome == "late"
    assert (resolution.steps, resolution.lag) == (3, 1)
    assert after[0].since_base == Tally(4, 40)
    assert after[0].in_flight is None
    # A record of a later round of the fragment also makes the snapshot late.
    after, resolution = ledger.recorded(record(4, 2, included=(ME,)), ME)
    assert resolution is not None
    assert resolution.outcome == "late"
    assert resolution.round == 2


def test_other_records_leave_the_ledger_alone() -> None:
    ledger = steps(Ledger.new(2), 3).published(0, 2)
    for other in (record(1, 2, included=(ME,)), record(0, 2, rejected=(ME,))):
        after, resolution = ledger.recorded(other, ME)
        assert resolution is None
        assert after == ledger
    idle = steps(Ledger.new(2), 3)
    assert idle.recorded(record(2, 2, included=(ME,)), ME) == (idle, None)


def test_publish_failure_keeps_the_steps_for_the_next_snapshot() -> None:
    ledger = steps(Ledger.new(1), 2).published(0, 0).publish_failed(0)
    ledger = steps(ledger, 1).published(0, 1)
    flight = ledger[0].in_flight
    assert flight is not None
    assert flight.covers == Tally(3, 30)


def test_dropped_at_close() -> None:
    ledger = steps(steps(Ledger.new(2), 2).published(1, 1), 1)
    ledger, dropped = ledger.dropped(1, "closed before round 1 committed")
    assert (dropped.fragment, dropped.steps, dropped.tokens) == (1, 3, 30)
    assert dropped.reason == "closed before round 1 committed"
    assert ledger[1].in_flight is None
    assert ledger[1].dropped == Tally(3, 30)
    assert ledger[1].balanced


def test_ledger_misuse_raises() -> None:
    ledger = steps(Ledger.new(2), 1).published(0, 0)
    with pytest.raises(ValueError, match="already has a snapshot in flight"):
        ledger.published(0, 2)
    with pytest.raises(ValueError, match="no snapshot in flight"):
        ledger.publish_failed(1)
    with pytest.raises(ValueError, match="no local step"):
        Ledger.new(1).published(0, 0)
    with pytest.raises(ValueError, match="non-negative"):
        ledger.stepped(-1)
    with pytest.raises(ValueError, match="fragment 2"):
        ledger.published(2, 2)
    with pytest.raises(ValueError, match="at least one fragment"):
        Ledger.new(0)


def test_start_is_new() -> None:
    assert Ledger.start(3) == Ledger.new(3)


# -- the invariant, over random histories -----------------------------------------------------


class LedgerMachine(RuleBasedStateMachine):
    """One learner among others; the run commits rounds in order, each of them including,
    rejecting or ignoring this learner's snapshot when it has one for that round."""

    def __init__(self) -> None:
        super().__init__()
        self.fragments = 3
        self.ledger = Ledger.new(self.fragments)
        self.next_round = 0
        self.total = Tally()
        self.included = [Tally() for _ in range(self.fragments)]
        self.dropped = [Tally() for _ in range(self.fragments)]
        self.covers: dict[int, Tally] = {}

    @rule(tokens=st.integers(0, 1000))
    def step(self, tokens: int) -> None:
        self.ledger = self.ledger.stepped(tokens)
        self.total += Tally(1, tokens)

    @rule(fragment=st.integers(0, 2), skip=st.integers(0, 2))
    def publish(self, fragment: int, skip: int) -> None:
        entry = self.ledger[fragment]
        round = self.next_round + (fragment - self.next_round) % self.fragments
        round += skip * self.fragments
        if entry.in_flight is not None or entry.since_base.steps == 0:
            with pytest.raises(ValueError, match=r"in flight|no local step"):
                self.ledger.published(fragment, round)
            return
        self.ledger = self.ledger.published(fragment, round)
        self.covers[fragment] = entry.since_base

    @rule(fragment=st.integers(0, 2))
    def publish_fails(self, fragment: int) -> None:
        if self.ledger[fragment].in_flight is None:
            return
        self.ledger = self.ledger.publish_failed(fragment)
        del self.covers[fragment]

    @rule(verdict=st.sampled_from(["included", "rejected", "absent"]))
    def commit(self, verdict: str) -> None:
        round = self.next_round
        fragment = round % self.fragments
        me = (ME,) if verdict != "absent" else ()
        rec = record(
            round,
            self.fragments,
            included=(*me, "peer") if verdict == "included" else ("peer",),
            rejected=me if verdict == "rejected" else (),
        )
        entry = self.ledger[fragment]
        self.ledger, resolution = self.ledger.recorded(rec, ME)
        self.next_round += 1
        flight = entry.in_flight
        if flight is None or flight.round > round:
            assert resolution is None
            return
        assert resolution is not None
        assert resolution.round == flight.round
        assert resolution.lag == entry.since_base.steps - flight.covers.steps
        del self.covers[fragment]
        if flight.round < round:
            assert resolution.outcome == "late"
        elif verdict == "included":
            assert resolution.outcome == "included"
            assert Tally(resolution.steps, resolution.tokens) == flight.covers
            self.included[fragment] += flight.covers
        elif verdict == "rejected":
            assert resolution.outcome == "rejected"
            assert Tally(resolution.steps, resolution.tokens) == entry.since_base
            self.dropped[fragment] += entry.since_base
        else:
            assert resolution.outcome == "late"
        if resolution.outcome == "late":
            assert self.ledger[fragment].since_base == entry.since_base

    @rule(fragment=st.integers(0, 2))
    def close(self, fragment: int) -> None:
        self.ledger, dropped = self.ledger.dropped(fragment, "closing")
        self.dropped[fragment] += Tally(dropped.steps, dropped.tokens)
        self.covers.pop(fragment, None)

    @invariant()
    def every_step_is_accounted_for_exactly_once(self) -> None:
        for f, entry in enumerate(self.ledger.fragments):
            assert entry.total == self.total
            assert entry.committed == self.included[f]
            assert entry.dropped == self.dropped[f]
            assert entry.committed + entry.dropped + entry.since_base == entry.total
            assert entry.since_base.steps >= 0
            assert entry.since_base.tokens >= 0
            if entry.in_flight is None:
                assert f not in self.covers
            else:
                assert entry.in_flight.covers == self.covers[f]


LedgerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_ledger_invariant = LedgerMachine.TestCase
