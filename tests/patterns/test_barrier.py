"""Barrier: a rendezvous through the store, under asyncio and trio."""

import math
from functools import partial

import anyio
import pytest
from _patterns_support import FaultyMailbox, QuickClock, eventually, first, listed, unavailable

from gradientmail.mailbox import MemoryMailbox
from gradientmail.patterns import Barrier
from gradientmail.patterns.barrier import arrivals

pytestmark = pytest.mark.anyio

POLL = 0.005


def test_arrivals_are_the_learners_one_segment_below_the_prefix() -> None:
    keys = ["barriers/b/x", "barriers/b/y", "barriers/b/z/deeper", "barriers/bb/w"]
    assert arrivals("barriers/b/", keys) == {"x", "y"}
    assert arrivals("barriers/b/", []) == frozenset()


async def test_opens_for_everyone_once_all_parties_arrived() -> None:
    mailbox = MemoryMailbox()
    results: dict[str, frozenset[str]] = {}

    async def node(learner: str) -> None:
        barrier = Barrier(mailbox, learner, poll_interval=POLL)
        results[learner] = await barrier.wait("start", parties=3)

    async with anyio.create_task_group() as tg:
        tg.start_soon(node, "a")
        tg.start_soon(node, "b")
        await listed(mailbox, "barriers/start/", 2)
        # Two of three have arrived: both must still be waiting, however long they poll.
        await anyio.sleep(POLL * 4)
        assert results == {}
        tg.start_soon(node, "c")
    assert results == dict.fromkeys("abc", frozenset("abc"))
    assert sorted(await mailbox.list("barriers/")) == [
        "barriers/start/a",
        "barriers/start/b",
        "barriers/start/c",
    ]


async def test_a_late_node_passes_an_open_barrier_at_once() -> None:
    mailbox = MemoryMailbox()
    async with anyio.create_task_group() as tg:
        for learner in ("a", "b"):
            tg.start_soon(
                partial(Barrier(mailbox, learner, poll_interval=POLL).wait, "go", parties=2)
            )
    clock = QuickClock()
    late = Barrier(mailbox, "c", clock=clock)
    assert await late.wait("go", parties=2) == {"a", "b", "c"}
    assert clock.sleeps == []


async def test_a_repeated_wait_after_opening_returns_without_sleeping() -> None:
    mailbox = MemoryMailbox()
    clock = QuickClock()
    a = Barrier(mailbox, "a", poll_interval=POLL, clock=clock)
    b = Barrier(mailbox, "b", poll_interval=POLL, clock=clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(a.wait, "epoch-1", parties=2))
        await eventually(lambda: bool(clock.sleeps))
        assert await b.wait("epoch-1", parties=2) == {"a", "b"}
    clock.sleeps.clear()
    assert await a.wait("epoch-1", parties=2, timeout=0) == {"a", "b"}
    assert await b.wait("epoch-1", parties=2) == {"a", "b"}
    assert POLL not in clock.sleeps
    assert len(await mailbox.list("barriers/epoch-1/")) == 2


async def test_timeout_says_how_many_of_how_many_arrived() -> None:
    mailbox = MemoryMailbox()
    await mailbox.put_if_absent("barriers/sync/other", b"")
    barrier = Barrier(mailbox, "me", poll_interval=POLL)
    with pytest.raises(
        TimeoutError, match=r"barrier 'sync': 2 of 5 nodes arrived within 0.05 s \(me, other\)"
    ):
        await barrier.wait("sync", parties=5, timeout=0.05)


async def test_a_timed_out_wait_can_be_resumed() -> None:
    mailbox = MemoryMailbox()
    a = Barrier(mailbox, "a", poll_interval=POLL)
    with pytest.raises(TimeoutError, match="1 of 2"):
        await a.wait("resume", parties=2, timeout=0.02)
    assert await mailbox.list("barriers/resume/") == ["barriers/resume/a"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(Barrier(mailbox, "b", poll_interval=POLL).wait, "resume", parties=2))
        assert await a.wait("resume", parties=2, timeout=10) == {"a", "b"}


async def test_zero_timeout_checks_once() -> None:
    barrier = Barrier(MemoryMailbox(), "a", poll_interval=POLL)
    with pytest.raises(TimeoutError, match="1 of 2"):
        await barrier.wait("now", parties=2, timeout=0)
    assert await barrier.wait("alone", parties=1, timeout=0) == {"a"}


async def test_transient_store_failures_are_retried() -> None:
    flaky = FaultyMailbox(first(3, "put_if_absent", unavailable))
    fault = first(2, "list", unavailable)
    put_faults = flaky.fault
    flaky.fault = lambda op, key: put_faults(op, key) or fault(op, key)
    clock = QuickClock()
    barrier = Barrier(flaky, "a", poll_interval=POLL, clock=clock)
    assert await barrier.wait("retry", parties=1) == {"a"}
    assert [op for op, _ in flaky.calls].count("put_if_absent") == 4
    assert [op for op, _ in flaky.calls].count("list") == 3
    assert clock.sleeps[:3] == [0.5, 1.0, 2.0]


async def test_an_unreachable_store_times_out_with_a_message_saying_so() -> None:
    dead = FaultyMailbox(lambda op, key: unavailable())
    barrier = Barrier(dead, "a", clock=QuickClock())
    with pytest.raises(TimeoutError, match=r"the store did not answer within 0\.5 s"):
        await barrier.wait("never", parties=2, timeout=0.5)


@pytest.mark.parametrize("limit", [None, 10.0])
async def test_a_store_error_propagates_as_itself(limit: float | None) -> None:
    broken = FaultyMailbox(lambda op, key: PermissionError("denied") if op == "list" else None)
    barrier = Barrier(broken, "a", poll_interval=POLL)
    with pytest.raises(PermissionError, match="denied"):
        await barrier.wait("broken", parties=2, timeout=limit)


@pytest.mark.parametrize("limit", [None, 10.0])
async def test_cancelling_a_wait_leaves_no_task_behind(limit: float | None) -> None:
    mailbox = MemoryMailbox()
    before = {task.id for task in anyio.get_running_tasks()}
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            barrier = Barrier(mailbox, "a", poll_interval=POLL)
            tg.start_soon(partial(barrier.wait, "cancel", parties=2, timeout=limit))
            await listed(mailbox, "barriers/cancel/", 1)
            scope.cancel()
    assert scope.cancelled_caught
    assert {task.id for task in anyio.get_running_tasks()} == before


@pytest.mark.parametrize("parties", [0, -1, True, 1.5, "2"])
async def test_parties_must_be_a_positive_int(parties: object) -> None:
    mailbox = MemoryMailbox()
    with pytest.raises(ValueError, match="parties must be an int of at least 1"):
        await Barrier(mailbox, "a").wait("x", parties=parties)  # type: ignore[arg-type]
    assert await mailbox.list("") == []


@pytest.mark.parametrize("name", ["", "a/b", ".", "..", "a\\b", "x" * 1100, 3])
async def test_names_must_be_one_key_segment(name: object) -> None:
    mailbox = MemoryMailbox()
    with pytest.raises(ValueError, match="invalid barrier name"):
        await Barrier(mailbox, "a").wait(name, parties=1)  # type: ignore[arg-type]
    assert await mailbox.list("") == []


@pytest.mark.parametrize("limit", [-1.0, math.nan, math.inf])
async def test_timeout_must_be_finite_and_not_negative(limit: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds at least 0"):
        await Barrier(MemoryMailbox(), "a").wait("x", parties=1, timeout=limit)


@pytest.mark.parametrize("learner", ["", "a/b", "-a", "a b", "é"])
def test_learner_must_be_a_valid_learner_id(learner: str) -> None:
    with pytest.raises(ValueError, match="invalid learner id"):
        Barrier(MemoryMailbox(), learner)


@pytest.mark.parametrize("poll", [0, -1, math.nan])
def test_poll_interval_must_be_positive(poll: float) -> None:
    with pytest.raises(
        ValueError, match="poll_interval must be a finite number of seconds greater than 0"
    ):
        Barrier(MemoryMailbox(), "a", poll_interval=poll)
