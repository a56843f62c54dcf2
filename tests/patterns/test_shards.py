"""``shard_of``/``Shard`` (pure) and ``declare`` (through a real store): every row in exactly
one shard, and a warning when two live learners declare the same shard."""

import warnings

import pytest

from gradientmail.mailbox import MemoryMailbox
from gradientmail.patterns import Shard, ShardOverlap, declare, shard_of
from gradientmail.store import Store


@pytest.mark.parametrize("length", [0, 1, 7, 100, 101])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_shards_cover_every_row_once_and_differ_by_at_most_one(length: int, count: int) -> None:
    parts = [Shard(i, count).indices(length) for i in range(count)]
    rows = [row for part in parts for row in part]
    assert rows == list(range(length))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    data = [f"row-{i}" for i in range(length)]
    assert [x for i in range(count) for x in Shard(i, count).take(data)] == data


def test_a_learner_list_gives_each_its_place_in_sorted_order() -> None:
    learners = ["host-b", "host-c", "host-a"]
    shards = {name: shard_of(name, learners=learners) for name in learners}
    assert shards == {"host-a": Shard(0, 3), "host-b": Shard(1, 3), "host-c": Shard(2, 3)}
    assert shard_of("node-12", count=16) == Shard(12, 16)


def test_bad_input_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="exactly one of learners"):
        shard_of("a-1")
    with pytest.raises(ValueError, match="not among the learners"):
        shard_of("a-1", learners=["a-2"])
    with pytest.raises(ValueError, match="lists an id twice"):
        shard_of("a-1", learners=["a-1", "a-1"])
    with pytest.raises(ValueError, match="does not end in a number"):
        shard_of("alpha", count=2)
    with pytest.raises(ValueError, match=r"index must be in \[0, 2\), got 2"):
        shard_of("host-2", count=2)
    with pytest.raises(TypeError, match="not one string"):
        shard_of("a", learners="abc")


@pytest.mark.anyio
async def test_declaring_a_live_learners_shard_warns_and_a_gone_ones_does_not() -> None:
    box = MemoryMailbox()
    store = Store(box)
    await store.beat("host-1", 0, "learner")
    await store.beat("host-3", 0, "learner")
    await declare(box, "host-1", Shard(1, 4))
    await declare(box, "host-3", Shard(3, 4))
    await declare(box, "gone-0", Shard(2, 4))  # no lease: its declaration is history
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await declare(box, "host-1", Shard(1, 4))  # a restart finds its own declaration
        await declare(box, "late-2", Shard(2, 4))
    assert caught == []
    with pytest.warns(ShardOverlap, match=r"'host-9' takes shard 1 of 4, .*: 'host-1' \(shard 1"):
        await declare(box, "host-9", Shard(1, 4))
    await store.beat("host-9", 0, "learner")
    # A third of the rows from the top: rows of shards 0 and 1 of 4, not of 3 of 4.
    with pytest.warns(ShardOverlap, match=r"'host-1' \(shard 1 of 4\), 'host-9' \(shard 1 of 4\);"):
        await declare(box, "host-8", Shard(0, 3))
