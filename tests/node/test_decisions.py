"""The syncer's pure decisions and round state machine, and the node's options, without I/O."""

from dataclasses import replace

import msgspec
import pytest

from gradientmail._node.options import NodeOptions
from gradientmail.protocol.cadence import counted_first
from gradientmail.protocol.expectation import MAX_PATIENCE_GRACES, Expectation, expectation
from gradientmail.protocol.records import (
    BlobRef,
    Participant,
    Rejection,
    RoundRecord,
    RunConfig,
)
from gradientmail.protocol.rounds import (
    AFTER_COMMIT,
    MAX_CLAIMS,
    Adopt,
    Again,
    Claim,
    CloseView,
    Commit,
    Follow,
    Resume,
    RoundObservation,
    RoundState,
    RoundView,
    TakeOver,
    Wait,
    decide_close,
    decide_round,
    due_for,
    observed,
    quorum_learners,
)


def view(**changes: object) -> RoundView:
    base: dict[str, object] = {
        "round": 7,
        "me": "a",
        "has_record": False,
        "claims": (),
        "live": frozenset({"a", "b"}),
        "following_since": None,
        "first_snapshot_at": None,
        "now": 100.0,
        "claim_timeout": 30.0,
    }
    base.update(changes)
    return RoundView(**base)  # type: ignore[arg-type]


def test_a_record_is_adopted_whatever_the_claims() -> None:
    assert decide_round(view(has_record=True, claims=((0, "a"),))) == Adopt()
    assert decide_round(view(has_record=True)) == Adopt()


def test_an_unclaimed_round_is_claimed_first() -> None:
    assert decide_round(view()) == Claim(0)


def test_our_own_last_claim_is_resumed() -> None:
    assert decide_round(view(claims=((0, "b"), (1, "a")))) == Resume()


def test_a_live_claimant_is_followed() -> None:
    assert decide_round(view(claims=((0, "b"),))) == Follow("b")
    later = view(claims=((0, "b"),), following_since=90.0, first_snapshot_at=95.0, now=124.9)
    assert decide_round(later) == Follow("b")


def test_a_gone_claimant_is_taken_over_at_once() -> None:
    assert decide_round(view(claims=((0, "c"),))) == TakeOver(1, "lease_gone")
    assert decide_round(view(claims=((0, "b"), (1, "c")))) == TakeOver(2, "lease_gone")


def test_no_record_within_the_timeout_is_taken_over() -> None:
    # The clock starts at the later of following and the first snapshot.
    late = view(claims=((0, "b"),), following_since=90.0, first_snapshot_at=95.0, now=125.0)
    assert decide_round(late) == TakeOver(1, "no_record")
    early = view(claims=((0, "b"),), following_since=110.0, first_snapshot_at=95.0, now=125.0)
    assert decide_round(early) == Follow("b")


def test_a_round_without_snapshots_never_times_out() -> None:
    idle = view(claims=((0, "b"),), following_since=0.0, first_snapshot_at=None, now=1e6)
    assert decide_round(idle) == Follow("b")


def test_only_live_learner_leases_count_toward_the_quorum() -> None:
    live = frozenset({"a", "b", "syncer"})
    assert quorum_learners(live, frozenset({"a", "b", "gone"})) == {"a", "b"}


CONFIG = RunConfig(quorum_min=2, quorum_fraction=0.5, grace=5.0)
QUORUM_ALL = RunConfig(quorum_fraction=1.0, grace=2.0)


def close(snapshots: set[str], learners: set[str], quorum_at: float | None, now: float) -> str:
    return decide_close(
        CloseView(
            snapshots=frozenset(snapshots),
            learners=frozenset(learners),
            quorum_at=quorum_at,
            now=now,
        ),
        CONFIG,
    )


def test_close_waits_for_quorum_min_and_fraction() -> None:
    assert close({"a"}, {"a"}, None, 0.0) == "waiting"  # below quorum_min
    many = {f"l{i}" for i in range(6)}
    assert close({"l0", "l1"}, many, None, 0.0) == "waiting"  # 2 < 0.5 * 6
    assert close({"l0", "l1", "l2"}, many, None, 0.0) == "grace"


def test_close_ends_grace_early_when_every_live_learner_published() -> None:
    assert close({"a", "b"}, {"a", "b"}, None, 0.0) == "close"
    assert close({"a", "b", "c"}, {"a", "b"}, 0.0, 0.1) == "close"


def test_close_after_grace() -> None:
    learners = {"a", "b", "c"}
    assert close({"a", "b"}, learners, 10.0, 14.9) == "grace"
    assert close({"a", "b"}, learners, 10.0, 15.0) == "close"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("poll_interval", 0),
        ("lease_every", -1.0),
        ("claim_timeout", float("inf")),
        ("close_timeout", float("nan")),
        ("max_retry_delay", 0.0),
        ("wait_poll_interval", -0.01),
    ],
)
def test_options_reject_bad_durations(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        NodeOptions(**{field: value})  # type: ignore[arg-type]


def test_a_due_round_is_polled_at_the_due_pace_never_slower_than_the_idle_one() -> None:
    options = NodeOptions()
    assert (options.pause(due=True), options.pause(due=False)) == (0.05, 1.0)
    assert NodeOptions(poll_interval=0.01).pause(due=True) == 0.01
    # A step waiting on the round polls faster still, never slower than the due pace.
    assert options.pause(due=True, waiting=True) == 0.005
    assert options.pause(due=False, waiting=True) == 1.0
    assert NodeOptions(wait_poll_interval=0.5).pause(due=True, waiting=True) == 0.05


def test_a_synchronous_round_with_a_snapshot_is_polled_at_the_wait_pace() -> None:
    """Every learner that published to a round of a synchronous run waits for its record."""
    state = RoundState(7, "a", claim_timeout=30.0).claimed(0.0)
    one = look(snapshots=frozenset({"a"}))
    synchronous = msgspec.structs.replace(CONFIG, overlap=0)
    paced = msgspec.structs.replace(CONFIG, overlap=2)
    assert observed(state, one, 0.0, synchronous)[1] == Wait(due=True, waited_on=True)
    assert observed(state, one, 0.0, paced)[1] == Wait(due=True)
    assert observed(state, look(), 0.0, synchronous)[1] == Wait()


def test_a_synchronous_round_is_polled_at_the_wait_pace_once_its_first_is_expected() -> None:
    """Its snapshots often all land within one due pause: the last is seen at the wait pace."""
    state = RoundState(7, "a", claim_timeout=30.0, due_from=10.0).claimed(0.0)
    synchronous = msgspec.structs.replace(CONFIG, overlap=0)
    assert observed(state, look(), 4.0, synchronous)[1] == Wait(due_at=10.0)
    assert observed(state, look(), 10.0, synchronous)[1] == Wait(due=True, waited_on=True)
    assert observed(state, look(), 10.0 + due_for(CONFIG), synchronous)[1] == Wait()
    assert observed(state, look(), 10.0, CONFIG)[1] == Wait(due=True)
    # With the first snapshot's time expected, the due pace runs until then, no later.
    timed = replace(state, expected_at=10.5)
    assert observed(timed, look(), 10.0, synchronous)[1] == Wait(due=True, due_at=10.5)
    assert observed(timed, look(), 10.5, synchronous)[1] == Wait(due=True, waited_on=True)
    assert observed(timed, look(), 10.0, CONFIG)[1] == Wait(due=True)


def test_a_round_is_due_just_after_the_one_before_it_ended() -> None:
    """A closing learner's flush lands as soon as it holds the version just committed."""
    opened = RoundState(7, "a", claim_timeout=30.0, due_from=20.0, opened_at=5.0).claimed(5.0)
    at = 5.0 + AFTER_COMMIT
    assert observed(opened, look(), 5.0, CONFIG)[1] == Wait(due=True, due_at=at)
    assert observed(opened, look(), at, CONFIG)[1] == Wait(due_at=20.0)
    unpaced = replace(opened, due_from=None)
    assert observed(unpaced, look(), 5.05, CONFIG)[1] == Wait(due=True, due_at=at)
    assert observed(unpaced, look(), at, CONFIG)[1] == Wait()
    # A round the pace already makes due keeps its pace.
    assert observed(replace(opened, due_from=4.0), look(), 5.0, CONFIG)[1] == Wait(due=True)


def test_options_reject_a_lease_timeout_within_one_beat() -> None:
    with pytest.raises(ValueError, match="lease_timeout"):
        NodeOptions(lease_every=2.0, lease_timeout=2.0)
    with pytest.raises(TypeError, match="syncer"):
        NodeOptions(syncer="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="poll_interval"):
        NodeOptions(poll_interval="1")  # type: ignore[arg-type]


def test_an_empty_round_closes_once_a_later_one_had_snapshots_for_grace() -> None:
    def empty(passed_at: float | None, now: float) -> str:
        return decide_close(
            CloseView(
                snapshots=frozenset(),
                learners=frozenset({"a"}),
                quorum_at=None,
                now=now,
                passed_at=passed_at,
            ),
            CONFIG,
        )

    assert empty(None, 1e6) == "waiting"
    assert empty(10.0, 14.9) == "waiting"
    assert empty(10.0, 15.0) == "close"


def test_a_claim_after_a_gap_is_foreign_and_the_claim_space_ends_without_an_exception() -> None:
    assert decide_round(view(claims=((9999, "b"),))) == Claim(0)
    assert decide_round(view(claims=((0, "b"), (5, "c")))) == Follow("b")
    taken = tuple((k, "gone") for k in range(MAX_CLAIMS))
    assert decide_round(view(claims=taken)) == Resume()


def look(**changes: object) -> RoundObservation:
    base: dict[str, object] = {
        "record": None,
        "claims": (),
        "snapshots": frozenset(),
        "live": frozenset({"a", "b"}),
        "learners": frozenset({"a", "b"}),
        "snapshots_at": 0.0,
        "leases_at": 0.0,
    }
    base.update(changes)
    return RoundObservation(**base)  # type: ignore[arg-type]


def test_the_machine_claims_closes_on_quorum_and_grace_then_commits() -> None:
    state = RoundState(7, "a", claim_timeout=30.0)
    state, step = observed(state, look(), 0.0, CONFIG)
    assert step == Claim(0)
    state = state.claimed(0.0)
    state, step = observed(state, look(snapshots_at=0.5), 0.5, CONFIG)
    assert step == Wait(due=False)  # nothing published: the round is not due yet
    state, step = observed(state, look(snapshots=frozenset({"a"}), snapshots_at=1.0), 1.0, CONFIG)
    assert step == Wait(due=True)  # one of two live learners is below quorum_min 2
    three = frozenset({"a", "b", "c"})
    both = look(snapshots=frozenset({"a", "b"}), live=three, learners=three, snapshots_at=2.0)
    state, step = observed(state, both, 2.0, CONFIG)
    assert (step, state.quorum_at) == (Wait(due=True), 2.0)
    state, step = observed(state, replace(both, snapshots_at=7.0, leases_at=7.0), 7.0, CONFIG)
    assert step == Commit(missing=frozenset({"c"}), published=frozenset({"a", "b"}))
    # Each snapshot's arrival is the first listing that held it, from the round's first.
    assert (state.arrived("a"), state.arrived("b"), state.arrived("c")) == (0.0, 1.0, None)


def test_a_round_whose_first_snapshot_is_expected_is_due_before_one_is_listed() -> None:
    """Before ``due_from`` the idle pause ends there; from it the round is polled at the
    due pace for ``due_for`` seconds; a listed snapshot times the window as before."""
    state = RoundState(7, "a", claim_timeout=30.0, due_from=10.0).claimed(0.0)
    assert observed(state, look(), 4.0, CONFIG)[1] == Wait(due_at=10.0)
    assert observed(state, look(), 10.0, CONFIG)[1] == Wait(due=True)
    late = 10.0 + due_for(CONFIG)
    assert observed(state, look(), late, CONFIG)[1] == Wait()
    one = look(snapshots=frozenset({"a"}), snapshots_at=late)
    state, step = observed(state, one, late, CONFIG)
    assert step == Wait(due=True)
    assert state.first_listed == late
    # A follower that listed a snapshot, then took the round over, listed it first then.
    follower = RoundState(7, "a", claim_timeout=30.0)
    follower, _ = observed(follower, look(claims=((0, "b"),), snapshots=one.snapshots), 3.0, CONFIG)
    follower, _ = observed(follower.claimed(4.0), one, late, CONFIG)
    assert follower.first_listed == 3.0
    assert observed(RoundState(7, "a", claim_timeout=30.0).claimed(0.0), look(), 4.0, CONFIG)[
        1
    ] == Wait(due_at=None)


def test_a_close_waits_for_a_lease_listing_newer_than_the_snapshots() -> None:
    state = RoundState(7, "a", claim_timeout=30.0).claimed(0.0)
    everyone = frozenset({"a", "b"})
    stale = look(snapshots=everyone, snapshots_at=5.0, leases_at=4.0)
    assert observed(state, stale, 5.0, CONFIG)[1] == Again(fresh=True)
    fresh = look(snapshots=everyone, snapshots_at=5.0, leases_at=5.0)
    assert observed(state, fresh, 5.0, CONFIG)[1] == Commit(frozenset(), everyone)


def test_a_record_is_adopted_by_the_machine_and_supersedes_a_close() -> None:
    record = object()
    state = RoundState(7, "a", claim_timeout=30.0)
    _, step = observed(state, look(record=record, claims=((0, "b"),)), 0.0, CONFIG)
    assert step == Adopt(record)  # type: ignore[arg-type]
    _, step = observed(state.claimed(0.0), look(record=record), 0.0, CONFIG)
    assert step == Adopt(record, superseded=True)  # type: ignore[arg-type]


def test_a_follower_announces_once_and_times_out_from_the_first_snapshot() -> None:
    state = RoundState(7, "a", claim_timeout=30.0)
    state, step = observed(state, look(claims=((0, "b"),)), 0.0, CONFIG)
    assert step == Follow("b", announce=True)
    state, step = observed(
        state, look(claims=((0, "b"),), snapshots=frozenset({"b"})), 10.0, CONFIG
    )
    assert step == Follow("b")
    state, step = observed(
        state, look(claims=((0, "b"),), snapshots=frozenset({"b"})), 40.0, CONFIG
    )
    assert step == TakeOver(1, "no_record")


def test_an_empty_round_stays_open_while_a_live_learner_has_not_moved_past_it() -> None:
    """One learner published two rounds ahead; the other, live, has not
    published anywhere yet. Closing the round empty would send the second learner's next
    snapshot ahead too, and the rounds would alternate one learner each for good."""
    state = RoundState(7, "a", claim_timeout=30.0).claimed(0.0)
    for now in (0.0, 10.0, 100.0):
        state, step = observed(state, look(later=frozenset({"b"})), now, CONFIG)
        assert step == Wait()
    state, step = observed(state, look(later=frozenset({"a", "b"})), 101.0, CONFIG)
    assert (step, state.passed_at) == (Wait(), 101.0)
    state, step = observed(state, look(later=frozenset({"a", "b"})), 106.0, CONFIG)
    assert step == Commit(missing=frozenset({"a", "b"}), published=frozenset())


def test_a_round_closes_without_live_learners_that_moved_past_it() -> None:
    """Three learners closing together (seen under load): c's last steps of this fragment
    missed the previous round and came here; a and b published all of theirs there, and
    their flush snapshots of the other fragment went to the next round, which cannot
    commit before this one. Waiting for a and b here waited for good, so every node gave
    up and the run ended on a flush round's look-ahead, without a final round."""
    three = frozenset({"a", "b", "c"})
    state = RoundState(19, "a", claim_timeout=30.0).claimed(0.0)
    c_only = {"snapshots": frozenset({"c"}), "live": three, "learners": three}
    state, step = observed(state, look(**c_only, later=frozenset({"a"})), 0.0, QUORUM_ALL)
    # b has not moved on: it may publish; c's snapshot makes the round due.
    assert (step, state.passed_at) == (Wait(due=True), None)
    state, step = observed(state, look(**c_only, later=frozenset({"a", "b"})), 1.0, QUORUM_ALL)
    assert (step, state.passed_at) == (Wait(due=True), 1.0)
    state, step = observed(state, look(**c_only, later=frozenset({"a", "b"})), 2.9, QUORUM_ALL)
    assert step == Wait(due=True)
    state, step = observed(state, look(**c_only, later=frozenset({"a", "b"})), 3.0, QUORUM_ALL)
    assert step == Commit(missing=frozenset({"a", "b"}), published=frozenset({"c"}))


def test_a_round_is_due_from_its_first_snapshot_for_twice_the_grace() -> None:
    """Closing a round, the syncer polls at the due pace from the first listing that held a
    snapshot until ``due_for`` (twice the 2 s grace) has passed; a round that still waits
    then (a stuck learner whose lease lives on) is polled at the idle pace."""
    state = RoundState(7, "a", claim_timeout=30.0).claimed(0.0)
    one = {"snapshots": frozenset({"a"}), "leases_at": 0.0}
    assert due_for(QUORUM_ALL) == 4.0
    state, step = observed(state, look(snapshots_at=1.0, **one), 1.0, QUORUM_ALL)
    assert step == Wait(due=True)
    state, step = observed(state, look(snapshots_at=4.9, **one), 4.9, QUORUM_ALL)
    assert step == Wait(due=True)
    state, step = observed(state, look(snapshots_at=5.0, **one), 5.0, QUORUM_ALL)
    assert step == Wait(due=False)
    assert state.arrivals == (("a", 1.0),)


def test_later_rounds_are_listed_only_while_a_live_learner_is_missing() -> None:
    state = RoundState(7, "a", claim_timeout=30.0)
    both = frozenset({"a", "b"})
    assert not state.wants_later(frozenset(), both)  # not holding the round
    state = state.claimed(0.0)
    assert state.wants_later(frozenset(), frozenset())
    assert state.wants_later(frozenset({"a"}), both)
    assert not state.wants_later(both, both)


def test_a_closer_looks_for_the_record_once_a_poll_interval_and_adopts_one_found() -> None:
    state = RoundState(7, "a", claim_timeout=30.0)
    assert state.wants_record(0.0, every=1.0)  # deciding: every look
    state, step = observed(state, look(record_at=0.0), 0.0, CONFIG)
    assert step == Claim(0)
    state = state.claimed(0.0)
    assert state.record_looked_at == 0.0
    assert not state.wants_record(0.5, every=1.0)
    one = look(snapshots=frozenset({"a"}), snapshots_at=0.5)
    state, _ = observed(state, one, 0.5, CONFIG)
    assert state.record_looked_at == 0.0  # a look without the record keeps the last one's time
    assert state.wants_record(1.0, every=1.0)
    record = took_part(a=None)
    state, step = observed(state, look(record=record, record_at=1.0), 1.0, CONFIG)
    assert step == Adopt(record, superseded=True)
    assert state.record_looked_at == 1.0


def test_an_empty_round_closes_once_everybody_left() -> None:
    state = RoundState(7, "a", claim_timeout=30.0).claimed(0.0)
    gone = look(live=frozenset(), later=frozenset({"b"}))
    state, step = observed(state, gone, 0.0, CONFIG)
    assert step == Wait()
    assert observed(state, gone, 5.0, CONFIG)[1] == Commit(frozenset(), frozenset())


def took_part(**paces: float | None) -> RoundRecord:
    """A committed round whose participants stated these step times (None: none)."""
    participants = tuple(
        Participant(learner=name, weight=1.0, steps=1, tokens=1, base_version=0)
        if pace is None
        else Participant(
            learner=name, weight=1.0, steps=1, tokens=1, base_version=0, step_time=pace
        )
        for name, pace in paces.items()
    )
    ref = BlobRef(sha256="0" * 64, size=1, encoding="fp32")
    return RoundRecord(
        round=6,
        fragment=2,
        version=2,
        committed_by="a",
        participants=participants,
        rejected=(Rejection(learner="r", reason="outlier", steps=1, tokens=1),),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        update=ref,
    )


ADAPTIVE = RunConfig(grace=1.0, overlap=None)


def test_an_adaptive_round_expects_who_took_part_in_the_one_before_for_a_bounded_time() -> None:
    previous = took_part(a=0.5, b=3.0, c=None)
    expected = expectation([previous], ADAPTIVE)
    assert expected == Expectation(frozenset({"a", "b", "c", "r"}), patience=4.0)
    absurd = expectation([took_part(a=1e6)], ADAPTIVE)
    assert absurd is not None
    assert absurd.patience == MAX_PATIENCE_GRACES * 1.0
    # The repeatable mode, the first round and a round nobody took part in: every live one.
    assert expectation([previous], RunConfig(overlap=2)) is None
    assert expectation([], ADAPTIVE) is None
    empty = msgspec.structs.replace(took_part(), rejected=())
    assert expectation([empty], ADAPTIVE) is None


def test_a_closing_learner_stays_expected_while_its_final_snapshots_may_come() -> None:
    """f's newest snapshot was a closing one (its final): rounds that follow, even without
    it, still expect it; g's closing snapshot was followed by an ordinary one."""
    final = Participant(learner="f", weight=1.0, steps=0, tokens=0, base_version=0, closing=True)
    g_closing = msgspec.structs.replace(final, learner="g")
    g_again = msgspec.structs.replace(g_closing, closing=msgspec.UNSET, steps=3)
    older = msgspec.structs.replace(took_part(a=0.5), participants=(final, g_closing))
    newer = msgspec.structs.replace(took_part(a=0.5), participants=(g_again,), rejected=())
    expected = expectation([older, newer], ADAPTIVE)
    assert expected is not None
    assert expected.learners == {"f", "g"}
    assert expected.closing == {"f"}


def test_an_adaptive_round_does_not_wait_for_a_live_learner_that_sat_the_last_one_out() -> None:
    """c holds a live lease but took no part in the round before (paused, hung, or just
    joined): the round closes once a and b published, with no grace."""
    three = frozenset({"a", "b", "c"})
    expected = Expectation(frozenset({"a", "b"}), patience=5.0)
    state = RoundState(7, "a", claim_timeout=30.0, expected=expected).claimed(0.0)
    both = look(snapshots=frozenset({"a", "b"}), live=three, learners=three, snapshots_at=1.0)
    _, step = observed(state, replace(both, leases_at=1.0), 1.0, ADAPTIVE)
    assert step == Commit(missing=frozenset(), published=frozenset({"a", "b"}))
    # The same round in the repeatable mode waits for c, a live learner.
    paced = RoundState(7, "a", claim_timeout=30.0).claimed(0.0)
    _, step = observed(paced, replace(both, leases_at=1.0), 1.0, RunConfig(grace=1.0, overlap=2))
    assert step == Wait(due=True)


def test_an_adaptive_round_waits_for_an_expected_learner_only_its_patience() -> None:
    """b took part in the round before and stated its pace; it is waited for until the
    patience after the round's first snapshot has passed, then the round closes without it
    (quorum 1.0 or not)."""
    both = frozenset({"a", "b"})
    expected = Expectation(both, patience=3.0)
    state = RoundState(7, "a", claim_timeout=30.0, expected=expected).claimed(0.0)
    only_a = {"snapshots": frozenset({"a"}), "live": both, "learners": both}
    state, step = observed(state, look(**only_a, snapshots_at=1.0, leases_at=1.0), 1.0, ADAPTIVE)
    assert step == Wait(due=True)
    state, step = observed(state, look(**only_a, snapshots_at=3.9, leases_at=3.9), 3.9, ADAPTIVE)
    assert step == Wait(due=True)
    _, step = observed(state, look(**only_a, snapshots_at=4.0, leases_at=4.0), 4.0, ADAPTIVE)
    assert step == Commit(missing=frozenset({"b"}), published=frozenset({"a"}))


def test_the_patience_starts_at_the_first_snapshot_of_a_learner_that_is_not_closing() -> None:
    """c is closing: its flush lands long before the round's pace expects a snapshot
    (``expected_at``, 10.0). The patience for b starts at a's snapshot once it is listed;
    before, with c's alone, at 10.0; without a closing learner, at the first snapshot."""
    both = frozenset({"a", "b"})
    expected = Expectation(both | {"c"}, patience=3.0, closing=frozenset({"c"}))
    assert expected.start([("c", 1.0), ("a", 11.0)], 10.0) == 11.0
    assert expected.start([("c", 1.0)], 10.0) == 10.0
    assert expected.start([("c", 1.0)], None) == 1.0
    assert expected.start([("c", 12.0)], 10.0) == 12.0
    assert Expectation(both, patience=3.0).start([("b", 1.0), ("a", 2.0)], 10.0) == 1.0
    three = both | {"c"}
    state = RoundState(7, "a", claim_timeout=30.0, expected=expected, expected_at=10.0)
    only_c = {"snapshots": frozenset({"c"}), "live": three, "learners": three}
    state, step = observed(
        state.claimed(0.0), look(**only_c, snapshots_at=1.0, leases_at=1.0), 1.0, ADAPTIVE
    )
    state, step = observed(state, look(**only_c, snapshots_at=12.9, leases_at=12.9), 12.9, ADAPTIVE)
    assert not isinstance(step, Commit)
    _, step = observed(state, look(**only_c, snapshots_at=13.0, leases_at=13.0), 13.0, ADAPTIVE)
    assert step == Commit(missing=frozenset({"a", "b"}), published=frozenset({"c"}))


def test_a_closing_learners_snapshot_is_not_a_rounds_first_for_the_cadence() -> None:
    """c closed and flushed at once, ahead of the pace: the round's first, for the cadence,
    is a's, the first of a learner that was not closing; a round of closing snapshots only
    keeps its first listed."""
    base = took_part(a=None, b=None, c=None)
    closers = tuple(
        msgspec.structs.replace(p, closing=True) if p.learner == "c" else p
        for p in base.participants
    )
    record = msgspec.structs.replace(base, participants=closers)
    arrivals = [("c", 2.0), ("a", 9.0), ("b", 9.5)]
    assert counted_first(arrivals, 2.0, record) == 9.0
    assert counted_first(arrivals, 2.0, base) == 2.0
    assert counted_first([("c", 2.0)], 2.0, record) == 2.0
    assert counted_first([], 1.5, record) == 1.5
