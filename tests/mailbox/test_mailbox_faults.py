"""FaultyMailbox: each injected fault does what a real store's would, counted and seeded."""

from functools import partial

import pytest

from gradientmail.mailbox import (
    FaultCounts,
    Faults,
    FaultyMailbox,
    MailboxUnavailable,
    MemoryMailbox,
    retrying,
)

pytestmark = pytest.mark.anyio


class RecordingClock:
    """Sleeps take no time; each is recorded."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def now(self) -> float:
        return sum(self.sleeps)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


async def test_without_faults_it_is_transparent() -> None:
    inner = MemoryMailbox()
    async with FaultyMailbox(inner, Faults()) as faulty:
        assert await faulty.put_if_absent("a/1", b"x")
        assert not await faulty.put_if_absent("a/1", b"y")
        assert await faulty.get("a/1") == b"x"
        assert await faulty.list("a/") == ["a/1"]
        await faulty.delete(["a/1"])
        assert await faulty.get("a/1") is None
    assert faulty.counts == FaultCounts(operations=6)
    assert faulty.inner is inner


async def test_unavailable_never_reaches_the_store() -> None:
    inner = MemoryMailbox()
    faulty = FaultyMailbox(inner, Faults(unavailable=1.0))
    for operation in (
        lambda: faulty.put_if_absent("k", b"x"),
        lambda: faulty.get("k"),
        lambda: faulty.list(""),
        lambda: faulty.delete(["k"]),
    ):
        with pytest.raises(MailboxUnavailable, match="injected fault"):
            await operation()
    assert await inner.list("") == []
    assert faulty.counts == FaultCounts(operations=4, unavailable=4)


async def test_a_conflict_writes_nothing() -> None:
    inner = MemoryMailbox()
    faulty = FaultyMailbox(inner, Faults(conflict=1.0))
    with pytest.raises(MailboxUnavailable, match="conflicted"):
        await faulty.put_if_absent("k", b"x")
    assert await inner.get("k") is None
    assert faulty.counts.conflict == 1


async def test_a_lost_reply_leaves_the_object_written() -> None:
    inner = MemoryMailbox()
    faulty = FaultyMailbox(inner, Faults(lost_reply=1.0))
    with pytest.raises(MailboxUnavailable, match=r"reply .* was lost"):
        await faulty.put_if_absent("k", b"mine")
    # The ambiguous case: the retry's False is for an object that is ours.
    assert await faulty.put_if_absent("k", b"mine") is False
    assert await inner.get("k") == b"mine"
    assert faulty.counts == FaultCounts(operations=2, lost_reply=1)


async def test_a_stale_listing_lags_one_poll_behind() -> None:
    inner = MemoryMailbox()
    faulty = FaultyMailbox(inner, Faults(stale_list=1.0))
    await inner.put_if_absent("p/1", b"")
    assert await faulty.list("p/") == ["p/1"]  # nothing to lag behind yet
    await inner.put_if_absent("p/2", b"")
    assert await faulty.list("p/") == ["p/1"]
    await inner.put_if_absent("p/3", b"")
    assert await faulty.list("p/", after="p/1") == ["p/2"]
    await inner.delete(["p/1"])
    assert await faulty.list("p/") == ["p/2", "p/3"]  # an earlier after cannot tell: fresh
    assert await faulty.list("p/") == ["p/2", "p/3"]
    assert faulty.counts.stale_list == 3


async def test_latency_sleeps_on_the_injected_clock() -> None:
    clock = RecordingClock()
    faulty = FaultyMailbox(MemoryMailbox(), Faults(latency=0.25), clock=clock)
    for index in range(20):
        await faulty.put_if_absent(f"k/{index}", b"")
    assert len(clock.sleeps) == 20
    assert all(0 < delay <= 0.25 for delay in clock.sleeps)
    assert faulty.counts.delayed == 20


async def test_the_same_seed_injects_the_same_faults() -> None:
    async def run(seed: int) -> list[str]:
        faulty = FaultyMailbox(MemoryMailbox(), Faults.uniform(0.3), seed=seed)
        outcomes = []
        for index in range(200):
            try:
                outcomes.append(str(await faulty.put_if_absent(f"k/{index % 50}", b"x")))
            except MailboxUnavailable as exc:
                outcomes.append(str(exc))
        return outcomes

    assert await run(7) == await run(7)
    assert await run(7) != await run(8)


async def test_retrying_survives_a_faulty_store_and_the_counts_add_up() -> None:
    clock = RecordingClock()
    faulty = FaultyMailbox(MemoryMailbox(), Faults(unavailable=0.3), seed=1, clock=clock)
    for index in range(100):
        await retrying(partial(faulty.put_if_absent, f"k/{index}", b"x"), clock=clock)
    counts = faulty.counts
    assert counts.unavailable > 10
    assert counts.operations == 100 + counts.unavailable
    assert len(await faulty.inner.list("k/")) == 100
    assert "unavailable=" in repr(faulty)


async def test_bad_keys_are_refused_before_any_fault() -> None:
    faulty = FaultyMailbox(MemoryMailbox(), Faults(unavailable=1.0))
    with pytest.raises(ValueError, match="invalid mailbox key"):
        await faulty.put_if_absent("/bad", b"")
    with pytest.raises(ValueError, match="invalid mailbox prefix"):
        await faulty.list("a//")
    assert faulty.counts == FaultCounts()


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"unavailable": -0.1}, "unavailable is a probability"),
        ({"lost_reply": 1.5}, "lost_reply is a probability"),
        ({"latency": -1.0}, "latency must be finite"),
        ({"latency": float("inf")}, "latency must be finite"),
    ],
)
def test_bad_fault_rates_are_refused(faults: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Faults(**faults)
