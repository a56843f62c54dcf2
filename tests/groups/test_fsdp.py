"""Learner groups of FSDP2 ranks (``fully_shard`` on a CPU mesh, gloo) in real processes on
a real directory: two 2-rank sharded learners and a single-process learner train one model;
each rank uploads and downloads its own rows; a sharded group creates a run; a killed rank
fails its group, which restarts and rejoins."""

import time
from pathlib import Path
from typing import Any

import anyio
from group_helpers import Ranks, check_run, kill_and_rejoin

from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol.records import Snapshot
from gradientmail.protocol.signing import RunKey
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
    # Each rank's weights, the whole parameters gathered from its group's shards.
    history = await check_run(run, out, reports, UNTIL_ROUND + 1, HIDDEN)
    await check_parts(Store(LocalMailbox(run)), len(history))


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
    # The sharded group creates a signed run: Θ⁰ gathered from its ranks, fragment by
    # fragment; every rank reads (and checks) the run's records with the run's key.
    env = {**ENV, "GRADIENTMAIL_RUN_KEY": "a secret of this run"}
    ranks.start("g1", 2, "async-trio", scenario="kill", until=10_000, env=env)
    kill_and_rejoin(ranks, "thread-trio", DEADLINE, env=env, hidden=HIDDEN)

    async def created_by() -> tuple[str, bool]:
        key = RunKey(env["GRADIENTMAIL_RUN_KEY"])
        manifest = await Store(LocalMailbox(ranks.run), run_key=key).manifest()
        assert manifest is not None
        return manifest.created_by, isinstance(manifest.key_id, str)

    assert anyio.run(created_by) == ("g1", True)
