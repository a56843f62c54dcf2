"""Learner groups of FSDP2 ranks (``fully_shard`` on a CPU mesh, gloo) in real processes on
a real directory: sharded learners of 2 and 3 ranks and a single-process learner train one
model, each rank uploading and downloading its own rows; a sharded group creates a signed
run; a killed rank fails its group, which restarts and rejoins."""

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


def test_sharded_groups_of_2_and_3_ranks_and_a_single_learner_train_one_model(
    ranks: Ranks,
) -> None:
    learners = (("g1", 2, "thread-trio"), ("g2", 3, "sync-asyncio"), ("s1", 1, "async-trio"))
    reports = ranks.train_together(learners, UNTIL_ROUND, DEADLINE, env=ENV)
    for name, report in reports.items():
        assert report["raised"] is None, f"{name}: {report['message']}"
    for learner, world, _ in learners[:2]:
        leader = reports[f"{learner}.0"]
        assert leader["world"] == world
        assert leader["tokens"] == 16 * world * leader["steps"]
        for rank in range(1, world):
            follower = reports[f"{learner}.{rank}"]
            for key in ("steps", "tokens", "versions", "round", "world"):
                assert leader[key] == follower[key], f"{learner}: {key} differs on rank {rank}"
            # Every rank moves its own rows' bytes; the group's links carry only control.
            assert follower["bytes_published"] > 0
            assert follower["bytes_downloaded"] > 0
            assert follower["group_received"] < follower["bytes_downloaded"]
    anyio.run(check, ranks.run, ranks.out, reports)


async def check(run: Path, out: Path, reports: dict[str, dict[str, Any]]) -> None:
    # Each rank's weights, the whole parameters gathered from its group's shards.
    history = await check_run(run, out, reports, UNTIL_ROUND + 1, HIDDEN)
    worlds = {name.split(".")[0]: reports[name]["world"] for name in reports}
    await check_parts(Store(LocalMailbox(run)), len(history), worlds)


async def check_parts(store: Store, rounds: int, worlds: dict[str, int]) -> None:
    """A sharded learner's snapshots are in parts, one per rank, each about 1/world of a
    whole snapshot of the same fragment; the single learner's are whole."""
    whole: dict[int, int] = {}
    parts: dict[str, dict[int, list[int]]] = {}
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
                parts.setdefault(snapshot.learner, {})[snapshot.fragment] = sizes
    assert whole
    sharded = {learner: world for learner, world in worlds.items() if world > 1}
    assert sorted(parts) == sorted(sharded)
    total_whole = sum(whole.values())
    for learner, world in sharded.items():
        assert {len(sizes) for sizes in parts[learner].values()} == {world}
        for rank in range(world):
            share = sum(sizes[rank] for sizes in parts[learner].values()) / total_whole
            # Rank 0 holds the one row of the output layer besides its share of the rest.
            assert abs(share - 1 / world) < 0.1, f"{learner}.{rank} uploads {share:.2f}"


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


def test_a_sharded_group_trains_through_a_store_that_fails(ranks: Ranks) -> None:
    # Every rank's node (its parts, its ranged reads; the leader's records and leases) sees
    # every kind of fault a real store returns, and retries through them.
    env = {**ENV, "GM_FAULTS": "0.05"}
    learners = (("g1", 2, "async-trio"), ("s1", 1, "async-asyncio"))
    reports = ranks.train_together(learners, UNTIL_ROUND, DEADLINE, env=env)
    for name, report in reports.items():
        assert report["raised"] is None, f"{name}: {report['message']}"
        assert report["faults"] > 0, f"{name} met no fault"
    assert reports["g1.0"]["versions"] == reports["g1.1"]["versions"]
    anyio.run(check, ranks.run, ranks.out, reports)
