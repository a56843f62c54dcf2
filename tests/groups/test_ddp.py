"""Learner groups of DDP ranks (gloo, CPU) in real processes on a real directory: two
2-rank groups and one single-process learner train one model; a rank that raises or hangs
makes every rank of its group raise."""

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import safetensors.torch
from group_helpers import Ranks
from node_helpers import assert_holds_committed, assert_steps_accounted, records, tiny_model

from gradientmail.events import StepsDropped
from gradientmail.mailbox import LocalMailbox

UNTIL_ROUND = 8
# Five processes starting torch and a gloo rendezvous on a loaded 2-core machine.
DEADLINE = 240.0


def test_two_groups_and_a_single_learner_train_one_model(ranks: Ranks) -> None:
    learners = (("g1", 2, "thread-trio"), ("g2", 2, "sync-asyncio"), ("s1", 1, "async-asyncio"))
    for learner, world, how in learners:
        ranks.start(learner, world, how, parties=len(learners), until=UNTIL_ROUND)
    deadline = time.monotonic() + DEADLINE
    reports = {
        f"{learner}.{rank}": ranks.wait(f"{learner}.{rank}", deadline)
        for learner, world, _ in learners
        for rank in range(world)
    }
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
    anyio.run(check, ranks.run, ranks.out, reports)


async def check(run: Path, out: Path, reports: dict[str, dict[str, Any]]) -> None:
    box = LocalMailbox(run)
    history = await records(box)
    assert len(history) >= UNTIL_ROUND + 1
    assert {p.learner for r in history for p in r.participants} == {"g1", "g2", "s1"}
    for name, report in reports.items():
        learner = name.split(".")[0]
        model = tiny_model()
        model.load_state_dict(safetensors.torch.load_file(str(out / f"{name}.safetensors")))
        await assert_holds_committed(box, model, report["versions"])
        if name.endswith(".0"):
            drops = [
                StepsDropped(learner, d["fragment"], d["steps"], d["tokens"], "")
                for d in report["drops"]
            ]
            assert_steps_accounted(learner, report["steps"], report["tokens"], drops, history)


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
    assert 2.0 <= leader["at"] - stepping < 20.0


def test_a_killed_rank_fails_its_group_which_restarts_and_rejoins(ranks: Ranks) -> None:
    ranks.start("g1", 2, "async-asyncio", scenario="kill")
    deadline = time.monotonic() + DEADLINE
    ranks.wait_for_file(ranks.out / "g1.stepping", deadline)
    killed_at = time.time()
    ranks.processes["g1.1"].send_signal(signal.SIGKILL)
    ranks.processes["g1.1"].wait()
    leader = ranks.wait("g1.0", deadline)
    assert leader["raised"] == "GroupFailed", leader["message"]
    # A dead peer closes its connections: the leader fails at once, not after the timeout.
    assert leader["at"] - killed_at < 20.0
    first_life = anyio.run(records, LocalMailbox(ranks.run))

    ranks.start("g1", 2, "thread-trio", until=len(first_life) + 4)
    deadline = time.monotonic() + DEADLINE
    again = [ranks.wait(f"g1.{rank}", deadline) for rank in range(2)]
    assert [r["raised"] for r in again] == [None, None]
    assert again[0]["versions"] == again[1]["versions"]
    assert again[0]["mismatches"] == again[1]["mismatches"] == 0

    async def rejoined() -> None:
        box = LocalMailbox(ranks.run)
        history = await records(box)
        later = history[len(first_life) :]
        assert any(p.learner == "g1" for r in later for p in r.participants)
        for rank in range(2):
            model = tiny_model()
            weights = safetensors.torch.load_file(str(ranks.out / f"g1.{rank}.safetensors"))
            model.load_state_dict(weights)
            await assert_holds_committed(box, model, again[rank]["versions"])

    anyio.run(rejoined)
