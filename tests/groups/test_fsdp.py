"""Learner groups of FSDP2 ranks (``fully_shard`` on a CPU mesh, gloo) in real processes on
a real directory: two 2-rank sharded learners and a single-process learner train one model;
each rank uploads and downloads its own rows; a sharded group creates a run; a killed rank
fails its group, which restarts and rejoins."""

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
from gradientmail.protocol.records import Snapshot
from gradientmail.store import Store

UNTIL_ROUND = 8
DEADLINE = 240.0
HIDDEN = 256
"""Wide enough that a part's bytes are its rows' (the encoding's header is ~1% of them)."""
ENV = {"GM_FSDP": "1", "GM_HIDDEN": str(HIDDEN)}


def test_two_sharded_groups_and_a_single_learner_train_one_model(ranks: Ranks) -> None:
    learners = (("g1", 2, "thread-trio"), ("g2", 2, "sync-asyncio"), ("s1", 1, "async-trio"))
    for learner, world, how in learners:
        ranks.start(learner, world, how, parties=len(learners), until=UNTIL_ROUND, env=ENV)
    deadline = time.monotonic() + DEADLINE
    reports = {
        f"{learner}.{rank}": ranks.wait(f"{learner}.{rank}", deadline)
        for learner, world, _ in learners
        for rank in range(world)
    }
    for name, report in reports.items():
        assert report["raised"] is None, f"{name}: {report['message']}"
    for learner in ("g1", "g2"):
        leader, follower = reports[f"{learner}.0"], reports[f"{learner}.1"]
        for key in ("steps", "tokens", "versions", "round", "world"):
            assert leader[key] == follower[key], f"{learner}: {key} differs between ranks"
        assert leader["world"] == 2
        assert leader["tokens"] == 32 * leader["steps"]
        # Every rank moves its own rows' bytes; the group's links carry only control.
        assert follower["bytes_published"] > 0
        assert follower["bytes_downloaded"] > 0
        assert follower["group_received"] < follower["bytes_downloaded"]
    anyio.run(check, ranks.run, ranks.out, reports)


async def check(run: Path, out: Path, reports: dict[str, dict[str, Any]]) -> None:
    box = LocalMailbox(run)
    history = await records(box)
    assert len(history) >= UNTIL_ROUND + 1
    assert {p.learner for r in history for p in r.participants} == {"g1", "g2", "s1"}
    for name, report in reports.items():
        learner = name.split(".")[0]
        model = tiny_model(hidden=HIDDEN)
        model.load_state_dict(safetensors.torch.load_file(str(out / f"{name}.safetensors")))
        # The whole parameters, gathered from the ranks' shards, are the committed θ.
        await assert_holds_committed(box, model, report["versions"])
        if name.endswith(".0"):
            drops = [
                StepsDropped(learner, d["fragment"], d["steps"], d["tokens"], "")
                for d in report["drops"]
            ]
            assert_steps_accounted(learner, report["steps"], report["tokens"], drops, history)
    await check_parts(Store(box), len(history))


async def check_parts(store: Store, rounds: int) -> None:
    """A sharded learner's snapshots are in parts, one per rank, each about half of a whole
    snapshot of the same fragment; the single learner's are whole."""
    whole: dict[int, int] = {}
    parts: dict[int, list[list[int]]] = {}
    for round in range(rounds):
        for snapshot, problem in await store.snapshots(round):
            assert problem is None, f"round {round}: {snapshot.learner}'s snapshot: {problem}"
            assert isinstance(snapshot, Snapshot)
            if snapshot.learner == "s1":
                assert snapshot.delta
                assert not snapshot.parts
                whole[snapshot.fragment] = snapshot.delta.size
            else:
                assert snapshot.parts
                assert not snapshot.delta
                sizes = [part.delta.size for part in snapshot.parts]
                parts.setdefault(snapshot.fragment, []).append(sizes)
    assert whole
    assert parts
    total_whole = sum(whole.values())
    for rank in range(2):
        share = sum(sizes[-1][rank] for sizes in parts.values()) / total_whole
        # Rank 0 holds the one row of the output layer besides its half of the rest.
        assert 0.4 < share < 0.62, f"rank {rank} uploads {share:.2f} of a whole snapshot"


def test_a_killed_sharded_rank_fails_its_group_which_restarts_and_rejoins(ranks: Ranks) -> None:
    # The sharded group creates the run: Θ⁰ gathered from its ranks, fragment by fragment.
    ranks.start("g1", 2, "async-trio", scenario="kill", until=10_000, env=ENV)
    deadline = time.monotonic() + DEADLINE
    ranks.wait_for_file(ranks.out / "g1.stepping", deadline)
    killed_at = time.time()
    ranks.processes["g1.1"].send_signal(signal.SIGKILL)
    ranks.processes["g1.1"].wait()
    leader = ranks.wait("g1.0", deadline)
    assert leader["raised"] == "GroupFailed", leader["message"]
    assert leader["at"] - killed_at < 20.0
    first_life = anyio.run(records, LocalMailbox(ranks.run))

    ranks.start("g1", 2, "thread-trio", until=len(first_life) + 4, env=ENV)
    deadline = time.monotonic() + DEADLINE
    again = [ranks.wait(f"g1.{rank}", deadline) for rank in range(2)]
    assert [r["raised"] for r in again] == [None, None]
    assert again[0]["versions"] == again[1]["versions"]

    async def rejoined() -> None:
        box = LocalMailbox(ranks.run)
        manifest = await Store(box).manifest()
        assert manifest is not None
        assert manifest.created_by == "g1"
        history = await records(box)
        later = history[len(first_life) :]
        assert any(p.learner == "g1" for r in later for p in r.participants)
        for rank in range(2):
            model = tiny_model(hidden=HIDDEN)
            weights = safetensors.torch.load_file(str(ranks.out / f"g1.{rank}.safetensors"))
            model.load_state_dict(weights)
            await assert_holds_committed(box, model, again[rank]["versions"])

    anyio.run(rejoined)
