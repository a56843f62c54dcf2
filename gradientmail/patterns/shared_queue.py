"""Split a data set among nodes without a coordinator: claim units through the store, prefetch
their items in a task of the queue's own."""

import inspect
import logging
import secrets
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    Set,
)
from contextlib import asynccontextmanager
from functools import partial
from typing import Generic, TypeAlias, TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.mailbox import Mailbox, check_key, retrying
from gradientmail.protocol.keys import check_learner

__all__ = ["UNITS", "Loaded", "SharedQueue", "claim_body", "next_unclaimed", "shared_queue"]

UNITS = "units/"
"""Where claims live: ``units/{id}``, one create-once object per claimed unit."""

_log = logging.getLogger("gradientmail.patterns")

# How long leaving the block waits for a loader's own cleanup (an async iterator's aclose).
_CLOSE_SECONDS = 30.0

Work = TypeVar("Work")
Item = TypeVar("Item")
T = TypeVar("T")

Loaded: TypeAlias = Iterable[Item] | AsyncIterable[Item] | Awaitable[Iterable[Item]]
"""What ``load(work)`` returns: a unit's items, as an iterable, an async iterable, or an
awaitable of an iterable."""


def claim_body(learner: str, token: str) -> bytes:
    """The bytes a queue writes into its claims: who claimed, and which queue instance."""
    return msgspec.json.encode({"learner": learner, "token": token})


def next_unclaimed(keys: Sequence[str], start: int, taken: Set[str]) -> int:
    """The index of the first of ``keys[start:]`` not in ``taken``; ``len(keys)`` if none."""
    for index in range(start, len(keys)):
        if keys[index] not in taken:
            return index
    return len(keys)


def _listing_prefix(keys: Sequence[str]) -> str:
    """The deepest ``/``-ended prefix every key shares, so a listing covers only this queue."""
    shared: list[str] = []
    for segments in zip(*(key.split("/")[:-1] for key in keys), strict=False):
        if any(segment != segments[0] for segment in segments):
            break
        shared.append(segments[0])
    return "".join(f"{segment}/" for segment in shared)


def _check_units(units: Mapping[str, object]) -> list[str]:
    if not isinstance(units, Mapping):
        raise TypeError(
            f"units must be a Mapping of unit id to work, got {type(units).__name__}: "
            "pass e.g. {f'shard-{i:05d}': path for i, path in enumerate(paths)}"
        )
    keys = []
    for unit in units:
        if not isinstance(unit, str):
            raise TypeError(f"unit ids must be str, got {unit!r} ({type(unit).__name__})")
        try:
            keys.append(check_key(f"{UNITS}{unit}"))
        except ValueError as exc:
            raise ValueError(
                f"invalid unit id {unit!r}: {exc}; ids are '/'-separated key segments, "
                "e.g. 'epoch-3/shard-00017'"
            ) from None
    return keys


def _check_prefetch(prefetch: int) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(
            f"prefetch must be an int of at least 1 (loaded items that may wait), got {prefetch!r}"
        )
    return prefetch


def _next_item(iterator: Iterator[T]) -> tuple[T] | None:
    try:
        return (next(iterator),)
    except StopIteration:
        return None


def _boxed(function: Callable[[T], Loaded[Item]], argument: T) -> tuple[Loaded[Item]]:
    return (function(argument),)


def _is_async(function: object) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


class SharedQueue(Generic[Item]):
    """The async iterator ``shared_queue`` gives: the loaded items of the units this node claimed.

    Iterating yields items in the order they were loaded, ends when no unit is left
    unclaimed in the store and every claimed unit's items have been yielded, and raises a
    loader's or the store's failure once every item loaded before it has been yielded. Any
    number of tasks of the block's event loop may iterate it; each item goes to one of them.
    Iterating after the block was left raises ``RuntimeError``.
    """

    def __init__(self, learner: str, total: int, receive: MemoryObjectReceiveStream[Item]) -> None:
        self._learner = learner
        self._total = total
        self._receive = receive
        self._claimed: list[str] = []
        self._failure: Exception | None = None
        self._state = "running"

    @property
    def claimed(self) -> tuple[str, ...]:
        """The ids of the units this queue has claimed so far, in claim order."""
        return tuple(self._claimed)

    def __aiter__(self) -> "SharedQueue[Item]":
        return self

    async def __anext__(self) -> Item:
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            pass
        except anyio.ClosedResourceError:
            raise RuntimeError(
                "this shared_queue's block was left; iterate it inside its 'async with'"
            ) from None
        # Raised outside the except clause so that the failure keeps its own cause and
        # context, untouched by the EndOfStream that revealed it.
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        raise StopAsyncIteration

    def __repr__(self) -> str:
        waiting = self._receive.statistics().current_buffer_used
        return (
            f"SharedQueue(learner={self._learner!r}, state={self._state}, "
            f"claimed={len(self._claimed)} of {self._total} units, waiting={waiting})"
        )


class _Producer(Generic[Work, Item]):
    """The task that claims units in mapping order and loads their items into the stream."""

    def __init__(
        self,
        queue: SharedQueue[Item],
        units: Mapping[str, Work],
        keys: list[str],
        mailbox: Mailbox,
        learner: str,
        load: Callable[[Work], Loaded[Item]],
        clock: Clock,
    ) -> None:
        self._queue = queue
        self._units = units
        self._ids = list(units)
        self._keys = keys
        self._mailbox = mailbox
        self._body = claim_body(learner, secrets.token_hex(8))
        self._load = load
        self._clock = clock

    async def run(self, send: MemoryObjectSendStream[Item]) -> None:
        async with send:
            try:
                await self._claim_and_load(send)
            except Exception as exc:
                # Handed to the consumer, who raises it after the items already loaded.
                self._queue._failure = exc
                self._queue._state = "failed"
            else:
                self._queue._state = "exhausted"

    async def _claim_and_load(self, send: MemoryObjectSendStream[Item]) -> None:
        if not self._keys:
            return
        prefix = _listing_prefix(self._keys)
        taken = await self._listing(prefix)
        position = 0
        while (position := next_unclaimed(self._keys, position, taken)) < len(self._keys):
            unit, key = self._ids[position], self._keys[position]
            position += 1
            if await self._claim(key):
                self._queue._claimed.append(unit)
                _log.debug("claimed unit %r", unit)
                await self._deliver(self._units[unit], send)
            else:
                # Others are ahead of us: one listing skips everything they took since.
                taken = await self._listing(prefix)

    async def _listing(self, prefix: str) -> frozenset[str]:
        return frozenset(await retrying(partial(self._mailbox.list, prefix), clock=self._clock))

    async def _claim(self, key: str) -> bool:
        if await retrying(partial(self._mailbox.put_if_absent, key, self._body), clock=self._clock):
            return True
        # False also answers a retried put whose first attempt created the object and lost
        # its reply: the body, unique to this queue, tells whose claim it is.
        held = await retrying(partial(self._mailbox.get, key), clock=self._clock)
        return held == self._body

    async def _deliver(self, work: Work, send: MemoryObjectSendStream[Item]) -> None:
        if _is_async(self._load):
            loaded = self._load(work)
        else:
            # Boxed: trio refuses a worker thread's result that is a coroutine, and a plain
            # function (a lambda) may return one; it is awaited below, on the loop.
            (loaded,) = await anyio.to_thread.run_sync(_boxed, self._load, work)
        if isinstance(loaded, AsyncIterable):
            await self._deliver_async(loaded, send)
            return
        if inspect.isawaitable(loaded):
            loaded = await loaded
        if isinstance(loaded, str | bytes | bytearray) or not isinstance(loaded, Iterable):
            raise TypeError(
                f"load returned {type(loaded).__name__}; it must return a unit's items as an "
                "iterable, an async iterable or an awaitable of an iterable (return [item] "
                "for one item per unit)"
            )
        if isinstance(loaded, list | tuple):
            for item in loaded:
                await send.send(item)
        else:
            await self._deliver_sync(loaded, send)

    async def _deliver_sync(
        self, items: Iterable[Item], send: MemoryObjectSendStream[Item]
    ) -> None:
        iterator = await anyio.to_thread.run_sync(iter, items)
        finished = False
        try:
            while (step := await anyio.to_thread.run_sync(_next_item, iterator)) is not None:
                await send.send(step[0])
            finished = True
        finally:
            close = getattr(iterator, "close", None)
            if not finished and callable(close):
                # A generator's cleanup (closing its file) runs in a worker thread too, and
                # runs even when the queue is being cancelled.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(close)

    async def _deliver_async(
        self, items: AsyncIterable[Item], send: MemoryObjectSendStream[Item]
    ) -> None:
        iterator = aiter(items)
        try:
            async for item in iterator:
                await send.send(item)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if callable(aclose):
                with anyio.move_on_after(_CLOSE_SECONDS, shield=True):
                    await aclose()


@asynccontextmanager
async def shared_queue(
    units: Mapping[str, Work],
    *,
    mailbox: Mailbox,
    learner: str,
    load: Callable[[Work], Loaded[Item]],
    prefetch: int = 8,
    clock: Clock | None = None,
) -> AsyncIterator[SharedQueue[Item]]:
    """Claim units through the store in mapping order and iterate their loaded items.

    ``async with shared_queue(units, mailbox=mb, learner=me, load=load) as items:``
    ``async for item in items: ...``

    Every node passes the same ``units`` (a mapping of unit id to the work that ``load``
    turns into items) and its own learner id. Each unit goes to the one node whose
    create-once claim ``units/{id}`` holds its body (the learner id and a token unique to
    this queue); a node that finds a unit claimed moves on. A put retried after a lost reply
    is recognised by reading the claim back. Claims are never removed: ids name a unit once
    per run, so a data set read once per epoch keys its units per epoch
    (``f"epoch-{e}/shard-{i}"``). A unit claimed by a node that stops before yielding all
    of its items stays claimed and unfinished (see ``docs/patterns.md``).

    ``load(work)`` returns the unit's items: an iterable, an async iterable, or an awaitable
    of an iterable. A plain function is called in a worker thread and every ``next()`` on
    its iterable runs in a worker thread, one at a time (lists and tuples are taken as
    they are); a coroutine or async generator function runs in the queue's task.

    Prefetching runs in one task of a task group the block owns: it claims a unit when it is
    ready to load it and keeps at most ``prefetch`` loaded items waiting for the consumer.
    Exhaustion means that no unit is left unclaimed, not that other nodes have finished
    theirs (follow the loop with a ``Barrier`` for that).

    Store operations are retried on ``clock`` while they raise ``MailboxUnavailable``. A
    loader's exception, or any other store error, ends prefetching and is raised from the
    iterator after the items loaded before it; a failure the consumer never reaches (it
    left the block first) is logged, not raised. Leaving the block, by exception or
    cancellation included, cancels prefetching: the block's exit waits for a worker thread
    in the middle of a ``next()`` to return, closes the unit's iterator and leaves no task
    or thread running. Units claimed whose items were not all yielded stay claimed.

    Raises ``TypeError`` or ``ValueError`` on entry, before any I/O, for units that are
    not a mapping of valid ids, an invalid learner id or ``prefetch`` below 1.
    """
    keys = _check_units(units)
    check_learner(learner)
    _check_prefetch(prefetch)
    # One slot fewer than ``prefetch``: the producer holds one more item, blocked in send().
    send, receive = anyio.create_memory_object_stream[Item](max_buffer_size=prefetch - 1)
    queue = SharedQueue[Item](learner, len(keys), receive)
    producer = _Producer(
        queue, units, keys, mailbox, learner, load, clock if clock is not None else MonotonicClock()
    )
    async with _prefetching(queue, producer, send, receive):
        yield queue


@asynccontextmanager
async def _prefetching(
    queue: SharedQueue[Item],
    producer: _Producer[Work, Item],
    send: MemoryObjectSendStream[Item],
    receive: MemoryObjectReceiveStream[Item],
) -> AsyncIterator[None]:
    """Run ``producer`` into ``send`` in a task group for the block's duration, cancelled
    when the block leaves; the block's own exception leaves as itself."""
    body_exit: BaseException | None = None
    with receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer.run, send)
            # The block's own exception is caught and re-raised after the task group so that
            # it leaves as itself, not wrapped in the task group's ExceptionGroup.
            try:
                yield
            except BaseException as exc:
                body_exit = exc
            finally:
                tg.cancel_scope.cancel()
        if queue._state == "running":
            queue._state = "closed"
        elif queue._failure is not None:
            _log.warning("shared_queue left before its failure was raised: %r", queue._failure)
    if body_exit is not None:
        raise body_exit
