"""A sharded rank's bookkeeping (``_node.sharded.ShardedRank``): the leader gathers every
rank's part of a snapshot for as long as that takes, fails at once when a rank reports its
upload failed (naming it), and ignores a part reported after the publish ended; a version
is taken only at the round prepared."""

import anyio
import pytest
import torch

from gradientmail._node.sharded import ShardedRank
from gradientmail.errors import MailboxUnavailable
from gradientmail.protocol.group import PartReport
from gradientmail.protocol.records import BlobRef, SnapshotPart

pytestmark = pytest.mark.anyio

ROWS = (((0, 2), (0, 1)), ((0, 3),))


def report(rank: int, round: int, fragment: int = 0, *, ok: bool = True) -> PartReport:
    if not ok:
        return PartReport(rank, round, fragment, None, None)
    ref = BlobRef(sha256=f"{rank:064x}", size=10 + rank, encoding="fp32")
    part = SnapshotPart(delta=ref, rows=((rank, rank + 1),))
    return PartReport(rank, round, fragment, part, 4.0)


async def test_the_leader_gathers_every_rank_part_in_rank_order() -> None:
    leader = ShardedRank(0, 3, ROWS)
    found = None

    async def gather() -> None:
        nonlocal found
        found = await leader.gathered(4, 0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(gather)
        await anyio.wait_all_tasks_blocked()
        leader.arrived([report(2, 4)])
        # The gatherer has seen that report and waits again: no limit, nothing failed.
        await anyio.wait_all_tasks_blocked()
        assert found is None
        leader.report(report(0, 4))
        leader.arrived([report(1, 4)])
    assert found is not None
    parts, norm = found.snapshot_parts()
    assert [p.delta.size for p in parts] == [10, 11, 12]
    assert norm == pytest.approx(12.0**0.5)


async def test_a_rank_whose_upload_failed_fails_the_snapshot_at_once() -> None:
    leader = ShardedRank(0, 3, ROWS)
    leader.report(report(0, 4))
    leader.arrived([report(2, 4, ok=False)])
    with pytest.raises(MailboxUnavailable, match=r"ranks \[2\] of the learner group could not"):
        await leader.gathered(4, 0)
    leader.end(4, 0)
    # Rank 1's late part is ignored; the next snapshot of the fragment gathers afresh.
    leader.arrived([report(1, 4), report(0, 6), report(1, 6), report(2, 6)])
    with anyio.fail_after(1):
        found = await leader.gathered(6, 0)
    assert [p.rank for p in found.parts if p is not None] == [0, 1, 2]
    leader.end(6, 0)
    leader.arrived([report(1, 6)])  # after the end: not kept, no "reported twice"


async def test_a_follower_sends_its_reports_once() -> None:
    follower = ShardedRank(1, 2, ROWS)
    follower.report(report(1, 4))
    assert [r.round for r in follower.outgoing()] == [4]
    assert follower.outgoing() == []


def test_a_version_is_taken_only_at_the_round_prepared() -> None:
    rank = ShardedRank(1, 2, ROWS)
    assert rank.prepared(0) is None
    theta = (torch.zeros(2), torch.zeros(1))
    rank.prepare(0, 6, theta)
    rank.prepare(0, 8, theta)
    assert rank.prepared(0) == 8
    with pytest.raises(RuntimeError, match="round 6 of fragment 0 is ready on every rank"):
        rank.take(0, 6)
    assert rank.take(0, 8) is theta
    assert rank.prepared(0) is None
