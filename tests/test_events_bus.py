"""The event bus: ordering, isolation of slow sinks, exact drop accounting, threads, closing."""

import collections
import logging
import threading
from collections.abc import Callable

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from gradientmail.events import Closed, Event, EventBus, EventsDropped, Joined

pytestmark = pytest.mark.anyio


def rounds(events: list[Event]) -> list[int | str]:
    """Each event as its round, or ``"dropped:N"`` for a notice."""
    out: list[int | str] = []
    for event in events:
        if isinstance(event, EventsDropped):
            out.append(f"dropped:{event.count}")
        else:
            assert isinstance(event, Closed)
            out.append(event.round)
    return out


async def until(condition: Callable[[], bool], within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - a plain condition, polled with a deadline
            await anyio.sleep(0.001)


class Gated:
    """An async sink that records each event, then waits for one permit per event."""

    def __init__(self) -> None:
        self.got: list[Event] = []
        self.closed = 0
        self._send, self._receive = anyio.create_memory_object_stream[None](1_000_000)

    def grant(self, permits: int) -> None:
        for _ in range(permits):
            self._send.send_nowait(None)

    async def __call__(self, event: Event) -> None:
        self.got.append(event)
        await self._receive.receive()

    async def aclose(self) -> None:
        self.closed += 1
        self._send.close()
        self._receive.close()


async def test_each_sink_gets_every_event_in_order() -> None:
    sync_got: list[Event] = []
    async_got: list[Event] = []

    async def slow(event: Event) -> None:
        if isinstance(event, Closed) and event.round % 7 == 0:
            await anyio.lowlevel.checkpoint()
        async_got.append(event)

    bus = EventBus([sync_got.append, slow])
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        for i in range(2000):
            bus.emit(Closed("a", i))
            if i % 16 == 0:
                await anyio.lowlevel.checkpoint()
        await bus.aclose()
    assert rounds(sync_got) == list(range(2000))
    assert rounds(async_got) == list(range(2000))


async def test_a_stuck_sink_delays_neither_the_producer_nor_another_sink() -> None:
    total, buffer = 100_000, 4096
    gate = anyio.Event()
    stuck_got: list[Event] = []
    healthy: list[Event] = []

    async def stuck(event: Event) -> None:
        stuck_got.append(event)
        await gate.wait()

    bus = EventBus([stuck, healthy.append], buffer=buffer)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        for i in range(total):
            bus.emit(Closed("a", i))
            if i % 32 == 0:
                await anyio.lowlevel.checkpoint()
        # The producer is done while the stuck sink still sits on its first event.
        assert not gate.is_set()
        assert rounds(stuck_got) == [0]
        await until(lambda: len(healthy) == total)
        assert rounds(healthy) == list(range(total))
        stuck_stats, healthy_stats = bus.statistics().sinks
        lost = total - 1 - buffer
        assert (stuck_stats.dropped, healthy_stats.dropped) == (lost, 0)
        gate.set()
        await bus.aclose()
    assert rounds(stuck_got) == [*range(buffer + 1), f"dropped:{lost}"]


async def test_a_notice_goes_in_just_before_the_next_event_that_fits() -> None:
    sink = Gated()
    bus = EventBus([sink], buffer=4, learner="me")
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.emit(Closed("a", 0))
        await until(lambda: len(sink.got) == 1)
        for i in range(1, 11):
            bus.emit(Closed("a", i))
        # 1..4 fill the stream; 5..10 are lost.
        await until(lambda: bus.statistics().sinks[0].dropped == 6)
        sink.grant(2)
        await until(lambda: len(sink.got) == 3)
        bus.emit(Closed("a", 11))
        await until(lambda: bus.statistics().pending == 0)
        sink.grant(100)
        await bus.aclose()
    assert rounds(sink.got) == [0, 1, 2, 3, 4, "dropped:6", 11]
    notice = sink.got[5]
    assert notice == EventsDropped("me", "Gated", 6)
    assert sink.closed == 1


async def test_a_notice_reaches_a_sink_that_catches_up_when_nothing_more_comes() -> None:
    sink = Gated()
    bus = EventBus([sink], buffer=8)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        bus.emit(Closed("a", 0))
        await until(lambda: len(sink.got) == 1)
        for i in range(1, 100):
            bus.emit(Closed("a", i))
        await until(lambda: bus.statistics().sinks[0].dropped == 91)
        sink.grant(9)
        # No event follows, yet the notice arrives once the stream is empty.
        await until(lambda: len(sink.got) == 10)
        assert sink.got[-1] == EventsDropped("a", "Gated", 91)
        sink.grant(100)
        for i in range(100, 105):
            bus.emit(Closed("a", i))
        await bus.aclose()
    assert rounds(sink.got) == [*range(9), "dropped:91", *range(100, 105)]
    stats = bus.statistics().sinks[0]
    assert (stats.dropped, stats.delivered) == (91, 9 + 1 + 5)


async def test_events_the_intake_cannot_hold_count_as_dropped_for_every_sink() -> None:
    first: list[Event] = []
    second: list[Event] = []
    bus = EventBus([first.append, second.append], buffer=10, learner="n")
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        # No checkpoint: the dispatcher cannot run, so the intake fills.
        for i in range(25):
            bus.emit(Closed("a", i))
        assert bus.statistics().pending == 10
        await bus.aclose()
    assert rounds(first) == [*range(10), "dropped:15"]
    assert rounds(second) == [*range(10), "dropped:15"]
    assert bus.statistics().emitted == 25


async def test_eight_threads_emitting_at_once_lose_nothing() -> None:
    threads, each = 8, 5000
    got: list[Event] = []
    bus = EventBus([got.append], buffer=threads * each)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        start = threading.Barrier(threads)

        def produce(thread: int) -> None:
            start.wait()
            for i in range(each):
                bus.emit(Closed(f"t{thread}", i))

        async with anyio.create_task_group() as producers:
            for thread in range(threads):
                producers.start_soon(anyio.to_thread.run_sync, produce, thread)
        await bus.aclose()
    assert len(got) == threads * each, _surplus(got)
    for thread in range(threads):
        mine = [e.round for e in got if isinstance(e, Closed) and e.learner == f"t{thread}"]
        assert mine == list(range(each))
    assert bus.statistics().sinks[0].dropped == 0


def _surplus(got: list[Event]) -> str:
    """What a sink got besides one of each emitted event: the kinds of event, and those it
    got more than once."""
    kinds = collections.Counter(type(event).__name__ for event in got)
    twice = [event for event, n in collections.Counter(got).items() if n > 1]
    return f"kinds {dict(kinds)}, got more than once: {twice[:20]}"


async def test_an_emit_from_a_thread_wakes_an_idle_dispatcher() -> None:
    got: list[Event] = []
    bus = EventBus([got.append])
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        for i in range(3):
            await until(lambda: bus._sleeping)
            await anyio.to_thread.run_sync(bus.emit, Closed("a", i))
            await until(lambda n=i + 1: len(got) == n, within=5)
        await bus.aclose()
    assert rounds(got) == [0, 1, 2]


async def test_a_raising_sink_is_logged_and_keeps_receiving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[Event] = []
    other: list[Event] = []

    def flaky(event: Event) -> None:
        seen.append(event)
        if isinstance(event, Closed) and event.round % 2:
            raise ValueError(f"bad round {event.round}")

    bus = EventBus([flaky, other.append])
    with caplog.at_level(logging.ERROR, logger="gradientmail.events"):
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            for i in range(6):
                bus.emit(Closed("a", i))
            await bus.aclose()
    assert rounds(seen) == list(range(6))
    assert rounds(other) == list(range(6))
    failures = [r for r in caplog.records if r.name == "gradientmail.events"]
    assert len(failures) == 3
    for record, round in zip(failures, (1, 3, 5), strict=True):
        assert record.levelno == logging.ERROR
        assert "flaky" in record.getMessage()
        assert "closed" in record.getMessage()
        assert record.exc_info is not None
        assert str(record.exc_info[1]) == f"bad round {round}"
    assert bus.statistics().sinks[0].failed == 3


class Recorder:
    """A sync sink object with ``close()``; it records whether events came after it."""

    def __init__(self) -> None:
        self.got: list[Event] = []
        self.closed_after: int | None = None

    def __call__(self, event: Event) -> None:
        assert self.closed_after is None, "event after close"
        self.got.append(event)

    def close(self) -> None:
        self.closed_after = len(self.got)


async def test_closing_drains_every_sink_then_closes_it() -> None:
    gated = Gated()
    recorder = Recorder()
    bus = EventBus([gated, recorder], buffer=1000)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        for i in range(500):
            bus.emit(Closed("a", i))
        gated.grant(500)
        await bus.aclose()
        bus.emit(Closed("a", 500))
        await bus.aclose()  # idempotent
    assert rounds(gated.got) == list(range(500))
    assert rounds(recorder.got) == list(range(500))
    assert recorder.closed_after == 500
    assert gated.closed == 1
    stats = bus.statistics()
    assert (stats.emitted, stats.refused) == (500, 1)
    assert "done" in repr(bus)


async def test_closing_a_bus_that_never_ran_delivers_what_was_emitted() -> None:
    recorder = Recorder()
    bus = EventBus([recorder])
    bus.emit(Joined("a", "a", 2, -1))
    bus.emit(Closed("a", 0))
    await bus.aclose()
    assert recorder.got == [Joined("a", "a", 2, -1), Closed("a", 0)]
    assert recorder.closed_after == 2
    with pytest.raises(RuntimeError, match="already started"):
        await bus.run()


async def test_closing_gives_up_on_a_stuck_sink_after_the_drain_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stuck = Gated()
    healthy = Recorder()
    bus = EventBus([stuck, healthy], drain_timeout=0.2)
    with caplog.at_level(logging.WARNING, logger="gradientmail.events"):
        async with anyio.create_task_group() as tg:
            await tg.start(bus.run)
            for i in range(10):
                bus.emit(Closed("a", i))
            with anyio.fail_after(10):
                await bus.aclose()
    assert rounds(healthy.got) == list(range(10))
    assert healthy.closed_after == 10
    assert stuck.closed == 1
    assert any("dropping the 9" in r.getMessage() for r in caplog.records)


async def test_cancelling_the_dispatcher_still_closes_sinks_and_ends_subscribers() -> None:
    recorder = Recorder()
    bus = EventBus([recorder])
    got: list[Event] = []
    ended = anyio.Event()

    async def read(task_status: anyio.abc.TaskStatus[None]) -> None:
        async with bus.subscribe() as events:
            task_status.started()
            async for event in events:
                got.append(event)
        ended.set()

    async with anyio.create_task_group() as outer:
        await outer.start(read)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                await tg.start(bus.run)
                bus.emit(Closed("a", 0))
                await until(lambda: len(recorder.got) == 1 and len(got) == 1)
                scope.cancel()
        await until(ended.is_set)
    assert recorder.closed_after == 1
    bus.emit(Closed("a", 1))
    assert bus.statistics().refused == 1


async def test_subscribers_see_every_event_in_order_and_end_when_the_bus_closes() -> None:
    bus = EventBus(learner="a")
    results: dict[str, list[Event]] = {}

    async def read(name: str, ready: anyio.Event, buffer: int) -> None:
        async with bus.subscribe(buffer) as events:
            ready.set()
            results[name] = [event async for event in events]

    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        first, second = anyio.Event(), anyio.Event()
        tg.start_soon(read, "first", first, 4096)
        tg.start_soon(read, "second", second, 4096)
        await first.wait()
        await second.wait()
        for i in range(300):
            bus.emit(Closed("a", i))
            await anyio.lowlevel.checkpoint()
        await bus.aclose()
    assert rounds(results["first"]) == list(range(300))
    assert rounds(results["second"]) == list(range(300))
    async with bus.subscribe() as late:
        assert [event async for event in late] == []


async def test_a_subscriber_that_falls_behind_gets_the_exact_count() -> None:
    bus = EventBus()
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        async with bus.subscribe(buffer=5) as events:
            for i in range(20):
                bus.emit(Closed("a", i))
            await until(lambda: bus.statistics().pending == 0)
            got = [await events.__anext__() for _ in range(6)]
            bus.emit(Closed("a", 20))
            got.append(await events.__anext__())
        await bus.aclose()
    assert rounds(got) == [0, 1, 2, 3, 4, "dropped:15", 20]
    assert got[5] == EventsDropped("a", "subscriber-1", 15)


def test_bad_arguments_are_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match=r"buffer=\.\.\.\) must be a positive integer"):
        EventBus(buffer=0)
    with pytest.raises(TypeError, match="callables taking one event"):
        EventBus(["not a sink"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="drain_timeout"):
        EventBus(drain_timeout=0)
    with pytest.raises(ValueError, match="subscribe"):
        EventBus().subscribe(buffer=-1)
