"""shared_queue in one process: claims, loaders, prefetch, failures and cancellation, under
asyncio and trio, on MemoryMailbox and on a real LocalMailbox directory."""

import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest
from _patterns_support import FaultyMailbox, QuickClock, eventually, first, unavailable

from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.patterns import shared_queue
from gradientmail.patterns.shared_queue import claim_body, next_unclaimed

UNITS = {f"u{i:03d}": i for i in range(200)}


def two_items(work: int) -> Iterator[tuple[int, int]]:
    yield work, 0
    yield work, 1


async def drain(queue: AsyncIterator[object]) -> list[object]:
    return [item async for item in queue]


async def collect(queue: AsyncIterator[object], into: list[object]) -> None:
    async for item in queue:
        into.append(item)


def test_next_unclaimed_skips_taken_keys_in_order() -> None:
    keys = ["units/c", "units/a", "units/b"]
    assert next_unclaimed(keys, 0, frozenset()) == 0
    assert next_unclaimed(keys, 0, {"units/c", "units/a"}) == 2
    assert next_unclaimed(keys, 1, {"units/b"}) == 1
    assert next_unclaimed(keys, 0, set(keys)) == 3
    assert next_unclaimed([], 0, frozenset()) == 0


def test_a_claim_names_its_learner_and_queue() -> None:
    body = claim_body("node-1", "abc")
    assert msgspec.json.decode(body) == {"learner": "node-1", "token": "abc"}
    assert body != claim_body("node-1", "abd")


# -- exactly once ---------------------------------------------------------------------------


@pytest.fixture(params=["memory", "local"])
async def mailbox(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Mailbox]:
    if request.param == "memory":
        yield MemoryMailbox()
    else:
        async with LocalMailbox(tmp_path / "store") as local:
            yield local


@pytest.mark.anyio
async def test_four_consumers_take_every_unit_exactly_once(mailbox: Mailbox) -> None:
    taken: dict[str, list[object]] = {}
    queues = {}

    async def consumer(learner: str) -> None:
        async with shared_queue(UNITS, mailbox=mailbox, learner=learner, load=two_items) as queue:
            queues[learner] = queue
            taken[learner] = []
            async for item in queue:
                taken[learner].append(item)
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for n in range(4):
            tg.start_soon(consumer, f"node-{n}")

    everything = [item for items in taken.values() for item in items]
    assert Counter(everything) == Counter((i, k) for i in range(200) for k in (0, 1))
    assert all(taken.values()), "every consumer should have had a share"
    keys = await mailbox.list("units/")
    assert keys == sorted(f"units/{unit}" for unit in UNITS)
    for learner, queue in queues.items():
        assert {UNITS[unit] for unit in queue.claimed} == {work for work, _ in taken[learner]}
        for unit in queue.claimed:
            body = await mailbox.get(f"units/{unit}")
            assert body is not None
            assert msgspec.json.decode(body)["learner"] == learner


@pytest.mark.anyio
async def test_units_are_claimed_in_mapping_order() -> None:
    units = {"z": 1, "a": 2, "m/deep": 3}
    async with shared_queue(
        units, mailbox=MemoryMailbox(), learner="a", load=lambda w: [w]
    ) as queue:
        assert await drain(queue) == [1, 2, 3]
        assert queue.claimed == ("z", "a", "m/deep")


@pytest.mark.anyio
async def test_a_unit_claimed_by_another_is_skipped() -> None:
    mailbox = MemoryMailbox()
    await mailbox.put_if_absent("units/b", claim_body("other", "t"))
    async with shared_queue(
        {"a": 1, "b": 2, "c": 3}, mailbox=mailbox, learner="me", load=lambda w: [w]
    ) as queue:
        assert await drain(queue) == [1, 3]
        assert queue.claimed == ("a", "c")


@pytest.mark.anyio
async def test_a_claim_whose_reply_was_lost_is_recognised_as_ours() -> None:
    lossy = FaultyMailbox(first(1, "put_if_absent", unavailable), lose_reply=True)
    async with shared_queue(
        {"a": 1, "b": 2}, mailbox=lossy, learner="me", load=lambda w: [w], clock=QuickClock()
    ) as queue:
        assert await drain(queue) == [1, 2]
        assert queue.claimed == ("a", "b")
    assert [op for op, key in lossy.calls if key == "units/a"] == [
        "put_if_absent",
        "put_if_absent",
        "get",
    ]


@pytest.mark.anyio
async def test_a_restarted_node_does_not_take_its_old_claims_again() -> None:
    mailbox = MemoryMailbox()
    units = {"a": 1, "b": 2, "c": 3}
    async with shared_queue(
        units, mailbox=mailbox, learner="me", load=lambda w: [w], prefetch=1
    ) as queue:
        assert await anext(queue) == 1
    assert "a" in queue.claimed
    async with shared_queue(units, mailbox=mailbox, learner="me", load=lambda w: [w]) as again:
        rest = await drain(again)
    assert 1 not in rest
    assert set(queue.claimed) | set(again.claimed) == set(units)
    assert not set(queue.claimed) & set(again.claimed)


@pytest.mark.anyio
async def test_units_keyed_per_epoch_are_read_again_each_epoch() -> None:
    mailbox = MemoryMailbox()
    shards = {f"shard-{i}": i for i in range(5)}
    for epoch in range(3):
        units = {f"epoch-{epoch}/{shard}": work for shard, work in shards.items()}
        async with shared_queue(units, mailbox=mailbox, learner="me", load=lambda w: [w]) as queue:
            assert await drain(queue) == list(range(5))
    assert len(await mailbox.list("units/")) == 15


# -- loaders --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_sync_loader_and_each_next_run_in_worker_threads() -> None:
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def load(work: int) -> Iterator[int]:
        threads.append(threading.get_ident())
        for k in range(3):
            threads.append(threading.get_ident())
            yield work * 10 + k

    async with shared_queue(
        {"a": 1, "b": 2}, mailbox=MemoryMailbox(), learner="me", load=load
    ) as queue:
        assert await drain(queue) == [10, 11, 12, 20, 21, 22]
    assert len(threads) == 8
    assert loop_thread not in threads


@pytest.mark.anyio
async def test_async_loaders_of_every_shape() -> None:
    async def agen(work: int) -> AsyncIterator[int]:
        for k in range(2):
            await anyio.lowlevel.checkpoint()
            yield work * 10 + k

    async def coroutine(work: int) -> list[int]:
        await anyio.lowlevel.checkpoint()
        return [work * 10, work * 10 + 1]

    units = {"a": 1, "b": 2}
    expected = [10, 11, 20, 21]
    for load in (agen, coroutine, lambda w: coroutine(w), lambda w: agen(w)):
        async with shared_queue(units, mailbox=MemoryMailbox(), learner="me", load=load) as queue:
            assert await drain(queue) == expected


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [7, "text", b"bytes"])
async def test_a_loader_returning_no_iterable_fails_after_earlier_items(bad: object) -> None:
    def load(work: int) -> object:
        return [work] if work == 1 else bad

    async with shared_queue(
        {"a": 1, "b": 2}, mailbox=MemoryMailbox(), learner="me", load=load
    ) as queue:  # type: ignore[arg-type]
        assert await anext(queue) == 1
        with pytest.raises(
            TypeError, match=r"load returned .*return \[item\] for one item per unit"
        ):
            await anext(queue)


# -- prefetch and failures ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("prefetch", [1, 3])
async def test_at_most_prefetch_loaded_items_wait(prefetch: int) -> None:
    loaded = 0

    async def load(work: int) -> AsyncIterator[int]:
        nonlocal loaded
        for k in range(4):
            loaded += 1
            yield work * 10 + k

    async with shared_queue(
        {"a": 1, "b": 2}, mailbox=MemoryMailbox(), learner="me", load=load, prefetch=prefetch
    ) as queue:
        await anyio.wait_all_tasks_blocked()
        assert loaded == prefetch
        for consumed in range(1, 6):
            await anext(queue)
            await anyio.wait_all_tasks_blocked()
            assert loaded == consumed + prefetch
        assert "waiting=" in repr(queue)


@pytest.mark.anyio
async def test_a_loader_failure_surfaces_after_the_items_already_loaded() -> None:
    def load(work: int) -> Iterator[int]:
        yield work * 10
        yield work * 10 + 1
        if work == 2:
            raise RuntimeError(f"cannot read shard {work}") from OSError("disk")

    units = {"a": 1, "b": 2, "c": 3}
    async with shared_queue(units, mailbox=MemoryMailbox(), learner="me", load=load) as queue:
        await eventually(lambda: "state=failed" in repr(queue))
        got: list[object] = []
        with pytest.raises(RuntimeError, match="cannot read shard 2") as raised:
            await collect(queue, got)
        assert isinstance(raised.value.__cause__, OSError)
        assert got == [10, 11, 20, 21]
        assert queue.claimed == ("a", "b")
        assert await drain(queue) == []


@pytest.mark.anyio
async def test_a_store_failure_surfaces_after_the_items_already_loaded() -> None:
    broken = FaultyMailbox(
        lambda op, key: PermissionError("store denied") if key == "units/c" else None
    )
    async with shared_queue(
        {"a": 1, "b": 2, "c": 3}, mailbox=broken, learner="me", load=lambda w: [w]
    ) as queue:
        await eventually(lambda: "state=failed" in repr(queue))
        assert await anext(queue) == 1
        assert await anext(queue) == 2
        with pytest.raises(PermissionError, match="store denied"):
            await anext(queue)


@pytest.mark.anyio
async def test_transient_store_failures_are_retried() -> None:
    calls = 0

    def flaky(op: str, key: str) -> BaseException | None:
        nonlocal calls
        calls += 1
        return unavailable() if calls % 2 else None

    async with shared_queue(
        {"a": 1, "b": 2, "c": 3},
        mailbox=FaultyMailbox(flaky),
        learner="me",
        load=lambda w: [w],
        clock=QuickClock(),
    ) as queue:
        assert await drain(queue) == [1, 2, 3]


# -- leaving the block ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelling_a_consumer_mid_iteration_leaves_nothing_running() -> None:
    entered = threading.Event()
    release = threading.Event()
    closed = threading.Event()

    def load(work: int) -> Iterator[int]:
        try:
            yield work
            entered.set()
            # Blocks the worker thread as a slow read would.
            release.wait(30)
            yield work + 1
        finally:
            closed.set()

    before = {task.id for task in anyio.get_running_tasks()}
    exited = anyio.Event()
    got = []

    async def consumer(scope: anyio.CancelScope) -> None:
        with scope:
            async with shared_queue(
                {"a": 1, "b": 2}, mailbox=MemoryMailbox(), learner="me", load=load
            ) as queue:
                async for item in queue:
                    got.append(item)
        exited.set()

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer, scope)
        await eventually(entered.is_set)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not exited.is_set(), "leaving must wait for the worker thread's next() to return"
        release.set()
        await exited.wait()
    assert got == [1]
    assert closed.is_set()
    assert scope.cancelled_caught
    assert {task.id for task in anyio.get_running_tasks()} == before


@pytest.mark.anyio
async def test_breaking_out_closes_an_async_loader_and_leaves_the_rest_unclaimed() -> None:
    closed = []

    async def load(work: int) -> AsyncIterator[int]:
        try:
            for k in range(100):
                yield work * 1000 + k
        except GeneratorExit:
            closed.append(work)
            raise

    mailbox = MemoryMailbox()
    units = {f"u{i}": i for i in range(10)}
    before = {task.id for task in anyio.get_running_tasks()}
    async with shared_queue(units, mailbox=mailbox, learner="me", load=load, prefetch=2) as queue:
        async for item in queue:
            if item == 1002:
                break
    assert {task.id for task in anyio.get_running_tasks()} == before
    assert closed == [1]
    assert queue.claimed == ("u0", "u1")
    assert "state=closed" in repr(queue)
    async with shared_queue(units, mailbox=mailbox, learner="other", load=lambda w: [w]) as rest:
        assert await drain(rest) == list(range(2, 10))
    with pytest.raises(RuntimeError, match="block was left"):
        await anext(queue)


@pytest.mark.anyio
async def test_an_exception_in_the_block_leaves_as_itself() -> None:
    async def consume_then_fail() -> None:
        async with shared_queue(
            UNITS, mailbox=MemoryMailbox(), learner="me", load=two_items
        ) as queue:
            await anext(queue)
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        await consume_then_fail()


@pytest.mark.anyio
async def test_cancelling_from_outside_the_block_leaves_nothing_running() -> None:
    before = {task.id for task in anyio.get_running_tasks()}
    with anyio.move_on_after(0.05) as scope:
        async with shared_queue(
            UNITS, mailbox=MemoryMailbox(), learner="me", load=two_items, prefetch=1
        ) as queue:
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert queue.claimed
    assert {task.id for task in anyio.get_running_tasks()} == before


# -- bad arguments --------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("units", "error", "match"),
    [
        (["a", "b"], TypeError, "units must be a Mapping"),
        ({1: "x"}, TypeError, "unit ids must be str"),
        ({"": 1}, ValueError, "invalid unit id ''"),
        ({"a//b": 1}, ValueError, "invalid unit id 'a//b'"),
        ({"../x": 1}, ValueError, r"invalid unit id '\.\./x'"),
    ],
)
async def test_bad_units_are_refused_before_any_io(
    units: object, error: type[Exception], match: str
) -> None:
    mailbox = FaultyMailbox(lambda op, key: AssertionError(f"no I/O expected, got {op}"))
    with pytest.raises(error, match=match):
        async with shared_queue(units, mailbox=mailbox, learner="me", load=list):  # type: ignore[arg-type]
            pass
    assert mailbox.calls == []


@pytest.mark.anyio
@pytest.mark.parametrize("prefetch", [0, -1, True, 2.0])
async def test_prefetch_must_be_a_positive_int(prefetch: object) -> None:
    with pytest.raises(ValueError, match="prefetch must be an int of at least 1"):
        async with shared_queue(
            {"a": 1}, mailbox=MemoryMailbox(), learner="me", load=list, prefetch=prefetch
        ):  # type: ignore[arg-type]
            pass


@pytest.mark.anyio
async def test_the_learner_must_be_a_valid_learner_id() -> None:
    with pytest.raises(ValueError, match="invalid learner id"):
        async with shared_queue({"a": 1}, mailbox=MemoryMailbox(), learner="a/b", load=list):
            pass


@pytest.mark.anyio
async def test_no_units_means_an_empty_queue() -> None:
    async with shared_queue({}, mailbox=MemoryMailbox(), learner="me", load=list) as queue:
        assert await drain(queue) == []
        assert "state=exhausted" in repr(queue)
