"""Learner groups of DDP ranks (gloo, CPU) in real processes on a real directory: two
2-rank groups and one single-process learner train one model; a rank that raises or hangs
makes every rank of its group raise."""

import time

import anyio
from group_helpers import Ranks, check_run, kill_and_rejoin
from node_helpers import assert_steps_accounted

from gradientmail.events import StepsDropped

UNTIL_ROUND = 8
# Five processes starting torch and a gloo rendezvous on a loaded 2-core machine.
DEADLINE = 240.0


def test_two_groups_and_a_single_learner_train_one_model(ranks: Ranks) -> None:
    learners = (("g1", 2, "thread-trio"), ("g2", 2, "sync-asyncio"), ("s1", 1, "async-asyncio"))
    reports = ranks.train_together(learners, UNTIL_ROUND, DEADLINE)
    for name, report in reports.items():
        assert report["raised"] is None, f"{name}: {report['message']}"
        assert report["mismatches"] == 0, f"{name}: ranks differed after a step"
    for learner in ("g1", "g2"):
        leader, follower = reports[f"{learner}.0"], reports[f"{learner}.1"]
        for key in ("steps", "tokens", "versions", "round", "world"):
            assert leader[key] == follower[key], f"{learner}: {key} differs between ranks"
        assert leader["world"] == 2
        assert leader["tokens"] == 32 * leader["steps"], "a group's tokens are its ranks' sum"
        # Only the leader talks to the store; the follower gets fragments from the leader.
        assert follower["bytes_published"] == follower["bytes_downloaded"] == 0
        assert leader["bytes_published"] > 0
        assert follower["group_received"] > leader["group_received"]
        assert leader["group_sent"] > follower["group_sent"]
    anyio.run(check_run, ranks.run, ranks.out, reports, UNTIL_ROUND + 1)


def test_a_rank_that_raises_fails_every_rank(ranks: Ranks) -> None:
    # No syncer: no round commits, so every step of the leader's learner is reported dropped
    # (a snapshot still in flight when a node fails could otherwise be both).
    env = {"GM_GROUP_TIMEOUT": "60", "GM_SYNCER": "0"}
    ranks.start("g1", 2, "thread-trio", scenario="raise", env=env)
    deadline = time.monotonic() + DEADLINE
    leader, follower = ranks.wait("g1.0", deadline), ranks.wait("g1.1", deadline)
    assert follower["raised"] == "RuntimeError"
    assert leader["raised"] == "GroupFailed", leader["message"]
    assert "rank 1 of the group left the block with an exception" in leader["message"]
    raised_at = float((ranks.out / "g1.raised-at").read_text())
    # The abort reaches the leader at once, far inside the 60 s group_timeout.
    assert leader["at"] - raised_at < 20.0
    assert leader["local_steps"] == 5
    # The leader's learner counted its sixth step before the exchange failed, and reports
    # every one of its steps dropped.
    assert leader["steps"] == 6
    drops = [
        StepsDropped("g1", d["fragment"], d["steps"], d["tokens"], "") for d in leader["drops"]
    ]
    assert_steps_accounted("g1", leader["steps"], leader["tokens"], drops, [])


def test_a_rank_that_hangs_fails_its_group_within_the_timeout(ranks: Ranks) -> None:
    ranks.start("g1", 2, "async-trio", scenario="hang", env={"GM_GROUP_TIMEOUT": "2"})
    deadline = time.monotonic() + DEADLINE
    leader = ranks.wait("g1.0", deadline)
    assert leader["raised"] == "GroupFailed", leader["message"]
    assert "did not complete" in leader["message"]
    stepping = float((ranks.out / "g1.stepping").read_text())
    # The hanging rank marks the file once it trained its sixth step, which can be a moment
    # after the leader began waiting on that step's exchange: the timeout runs from there.
    assert 1.9 <= leader["at"] - stepping < 20.0


def test_a_killed_rank_fails_its_group_which_restarts_and_rejoins(ranks: Ranks) -> None:
    ranks.start("g1", 2, "async-asyncio", scenario="kill")
    kill_and_rejoin(ranks, "thread-trio", DEADLINE)
