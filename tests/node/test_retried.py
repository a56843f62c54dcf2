"""Each of the node's retry handlers, driven directly over a store that gives up after one
try: it still reports and retries a transient failure (``MailboxUnavailable``), and lets
the store's refusal (``StoreAccessError``, the operator's) out at once, unretried."""

import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
import pytest
from node_helpers import CONFIG, FAST, LEARNER_ONLY, tiny_model, wait_until
from torch import nn

from gradientmail._node import node as open_node
from gradientmail._node.commit import FragmentState, SyncerState, collect_garbage
from gradientmail._node.group_member import fragment_params
from gradientmail._node.learner_driver import LearnerDriver
from gradientmail._node.lease import release
from gradientmail._node.receive import Receiver
from gradientmail._node.run_creation import load_newest
from gradientmail._node.runtime import Runtime
from gradientmail._node.syncer_task import run_syncer
from gradientmail.clock import MonotonicClock
from gradientmail.errors import MailboxUnavailable, StoreAccessError
from gradientmail.events import (
    Event,
    PollFailed,
    PublishFailed,
    Recovered,
    RecoveryFailed,
    ReleaseFailed,
    RoundFailed,
    SnapshotPublished,
)
from gradientmail.mailbox import LocalAccessError, MemoryMailbox, S3AccessError
from gradientmail.protocol.checkpoint import retained
from gradientmail.protocol.learner import Learner
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

E = TypeVar("E")


def _local_refusal() -> StoreAccessError:
    return LocalAccessError(errno.EACCES, "Permission denied in mailbox directory", "/run")


def _s3_refusal() -> StoreAccessError:
    response = {"Error": {"Code": "NoSuchBucket"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    return S3AccessError(response, "ListObjectsV2", "gone", "http://127.0.0.1:9")


REFUSALS = pytest.mark.parametrize("refusal", [_local_refusal, _s3_refusal], ids=["local", "s3"])


class Scripted(MemoryMailbox):
    """A memory mailbox that raises queued errors, in order, from the operations they were
    queued for (``"put"``, ``"get"``, ``"list"``, ``"delete"``) on keys or prefixes that
    start with the prefix given."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: list[tuple[str, str, Exception]] = []

    def fail(self, operation: str, prefix: str, *errors: Exception) -> None:
        self.queued.extend((operation, prefix, error) for error in errors)

    def _next(self, operation: str, key: str) -> None:
        for index, (queued_op, prefix, error) in enumerate(self.queued):
            if queued_op == operation and key.startswith(prefix):
                del self.queued[index]
                raise error

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        self._next("put", key)
        return await super().put_if_absent(key, data)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._next("get", key)
        return await super().get(key, max_bytes=max_bytes)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self._next("list", prefix)
        return await super().list(prefix, after=after)


async def _run(model: nn.Module | None = None) -> tuple[Scripted, Runtime, list[Event]]:
    """A run created by a learner that left at once, and the runtime of a node of it whose
    store tries every operation once (so a transient failure reaches the handler)."""
    box = Scripted()
    async with open_node(
        model or tiny_model(), box, learner="creator", config=CONFIG, options=LEARNER_ONLY
    ):
        pass
    events: list[Event] = []
    clock = MonotonicClock()
    store = Store(box, clock=clock, max_retry_delay=FAST.max_retry_delay, attempts=1)
    manifest = await store.manifest()
    assert manifest is not None
    rt = Runtime("n", store, manifest, FAST, clock, events.append)
    return box, rt, events


def _of(events: list[Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


async def _until(holds: Callable[[], bool]) -> None:
    async def condition() -> bool:
        return holds()

    await wait_until(condition, limit=10)


async def _fails_with(task: Callable[[], Awaitable[object]], refusal: StoreAccessError) -> None:
    """``task`` raises ``refusal`` itself, promptly."""
    with anyio.fail_after(10), pytest.raises(type(refusal)) as raised:
        await task()
    assert raised.value is refusal


async def test_the_syncer_retries_an_unavailable_store_when_recovering_and_on_a_round() -> None:
    box, rt, events = await _run()
    box.fail("list", "records/", MailboxUnavailable("records/ timed out"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_syncer, rt)
        await _until(lambda: len(_of(events, Recovered)) >= 1)
        failed = _of(events, RecoveryFailed)
        assert [str(e.error) for e in failed] == ["records/ timed out"]
        box.fail("list", "", MailboxUnavailable("listing timed out"))
        await _until(lambda: len(_of(events, Recovered)) >= 2)
        tg.cancel_scope.cancel()
    assert [str(e.error) for e in _of(events, RoundFailed)] == ["listing timed out"]
    assert not box.queued


@REFUSALS
@pytest.mark.parametrize("when", ["recovering", "on-a-round"])
async def test_the_syncer_fails_at_once_when_the_store_refuses_it(
    refusal: Callable[[], StoreAccessError], when: str
) -> None:
    box, rt, events = await _run()
    error = refusal()
    if when == "recovering":
        box.fail("list", "records/", error)
        await _fails_with(lambda: run_syncer(rt), error)
        assert not _of(events, RecoveryFailed)
        return

    async def refused_after_recovering() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_syncer, rt)
            await _until(lambda: bool(_of(events, Recovered)))
            box.fail("list", "", error)

    with anyio.fail_after(10), pytest.raises(ExceptionGroup) as raised:
        await refused_after_recovering()
    assert raised.value.exceptions == (error,)
    assert not _of(events, RoundFailed)


def _collecting(rt: Runtime) -> int:
    """A round after whose commit garbage collection has something to delete
    (``checkpoint.retained`` lets go of a record or a round), so it reads the store."""
    config = rt.config
    start = max(config.keep_rounds, config.fragments * config.keep_versions)
    span = 4 * config.fragments * config.checkpoint_interval
    for r in range(start, start + span):
        before, now = retained(r - 1, config), retained(r, config)
        if before.records - now.records or before.snapshots - now.snapshots:
            return r
    raise AssertionError(f"no round in [{start}, {start + span}) lets anything go")


async def test_garbage_collection_leaves_an_unavailable_store_for_the_next_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    box, rt, _ = await _run()
    round = _collecting(rt)
    state = SyncerState(next_round=round + 1, fragments=(FragmentState(0, None),) * 2)
    box.fail("get", "records/", MailboxUnavailable("records/ timed out"))
    with caplog.at_level(logging.WARNING, logger="gradientmail"):
        assert await collect_garbage(rt, state, round) == state
    assert f"garbage collection after round {round} failed: records/ timed out" in caplog.text
    assert not box.queued


@REFUSALS
async def test_garbage_collection_fails_when_the_store_refuses_it(
    refusal: Callable[[], StoreAccessError],
) -> None:
    box, rt, _ = await _run()
    round = _collecting(rt)
    state = SyncerState(next_round=round + 1, fragments=(FragmentState(0, None),) * 2)
    error = refusal()
    box.fail("get", "records/", error)
    await _fails_with(lambda: collect_garbage(rt, state, round), error)


async def test_releasing_the_lease_retries_an_unavailable_store_then_reports_it() -> None:
    box, rt, events = await _run()
    await rt.store.beat("n", 1, "learner")
    box.fail("list", "leases/n/", *(MailboxUnavailable(f"try {n}") for n in range(3)))
    await release(rt.store, "n", events.append)
    assert [str(e.error) for e in _of(events, ReleaseFailed)] == ["try 2"]
    assert not box.queued
    await release(rt.store, "n", events.append)
    assert await rt.store.own_beats("n") == []


@REFUSALS
async def test_releasing_the_lease_fails_when_the_store_refuses_it(
    refusal: Callable[[], StoreAccessError],
) -> None:
    box, rt, events = await _run()
    error = refusal()
    box.fail("list", "leases/n/", error)
    await _fails_with(lambda: release(rt.store, "n", events.append), error)
    assert not _of(events, ReleaseFailed)


@asynccontextmanager
async def _driven(rt: Runtime, model: nn.Module) -> AsyncIterator[LearnerDriver]:
    """The driver of a learner joining with ``model`` (which holds the run's θ⁰), its
    publisher running until the block ends."""
    newest = await load_newest(rt.store, rt.manifest, rt.clock, rt.options.poll_interval)
    params = fragment_params(rt.manifest, list(model.named_parameters()))
    learner = Learner.start(rt.config, rt.learner, newest.versions, newest.thetas, newest.round)
    driver = LearnerDriver(rt, learner, params, lambda: None)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(driver.run_publisher)
            yield driver
            driver.close_jobs()
    finally:
        driver.close_jobs()


async def test_the_receive_loop_reports_an_unavailable_store_and_polls_on() -> None:
    model = tiny_model()
    box, rt, events = await _run(model)
    async with _driven(rt, model) as driver, anyio.create_task_group() as tg:
        box.fail("list", "records/", MailboxUnavailable("first"), MailboxUnavailable("second"))
        tg.start_soon(Receiver(rt, driver).run)
        await _until(lambda: not box.queued and len(events) >= 2)
        tg.cancel_scope.cancel()
    assert [str(e.error) for e in _of(events, PollFailed)] == ["first", "second"]


@REFUSALS
async def test_the_receive_loop_fails_at_once_when_the_store_refuses_it(
    refusal: Callable[[], StoreAccessError],
) -> None:
    model = tiny_model()
    box, rt, events = await _run(model)
    error = refusal()
    async with _driven(rt, model) as driver:
        box.fail("list", "records/", error)
        await _fails_with(Receiver(rt, driver).run, error)
    assert not _of(events, PollFailed)


async def _step_until(driver: LearnerDriver, done: Callable[[], bool]) -> None:
    """Step the driver (its publisher publishing the snapshots due) until ``done``."""
    with anyio.fail_after(10):
        while not done():
            driver.step(16)
            await anyio.sleep(0.01)


async def test_the_publisher_reports_an_unavailable_store_and_publishes_the_next_snapshot() -> None:
    model = tiny_model()
    box, rt, events = await _run(model)
    box.fail("put", "blobs/", MailboxUnavailable("put timed out"))
    async with _driven(rt, model) as driver:
        await _step_until(driver, lambda: bool(_of(events, SnapshotPublished)))
    assert [str(e.error) for e in _of(events, PublishFailed)] == ["put timed out"]
    assert not box.queued


@REFUSALS
async def test_the_publisher_fails_at_once_when_the_store_refuses_it(
    refusal: Callable[[], StoreAccessError],
) -> None:
    model = tiny_model()
    box, rt, events = await _run(model)
    error = refusal()
    box.fail("put", "blobs/", error)
    with pytest.raises(ExceptionGroup) as raised:
        async with _driven(rt, model) as driver:
            await _step_until(driver, lambda: False)
    assert raised.value.exceptions == (error,)
    assert not _of(events, PublishFailed)
