"""The syncer's pure decisions and the node's options, without I/O."""

import pytest

from gradientmail._node.options import NodeOptions
from gradientmail.protocol.records import RunConfig
from gradientmail.protocol.rounds import (
    Adopt,
    Claim,
    CloseView,
    Follow,
    Resume,
    RoundView,
    TakeOver,
    decide_close,
    decide_round,
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
    ],
)
def test_options_reject_bad_durations(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        NodeOptions(**{field: value})  # type: ignore[arg-type]


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
