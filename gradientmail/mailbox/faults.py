"""A mailbox that misbehaves on purpose, reproducibly: for soak tests, yours and ours.

``FaultyMailbox(inner, Faults(...), seed=...)`` forwards every operation to ``inner`` and,
with the probabilities in ``Faults``, injects the failures a real store produces:

- ``unavailable``: the operation raises ``MailboxUnavailable`` without reaching the store.
- ``conflict``: a ``put_if_absent`` raises ``MailboxUnavailable`` as S3Mailbox does after
  repeated 409 ``ConditionalRequestConflict``; nothing is written.
- ``lost_reply``: a ``put_if_absent`` that *created* its object raises ``MailboxUnavailable``
  anyway, as when the connection drops after the store committed the write. A retry then
  gets False for an object that is its own: the ambiguous case every writer must handle by
  reading the object back.
- ``stale_list``: ``list`` answers as the store stood at the previous ``list`` of the same
  prefix, one poll behind: that listing, cut at this call's ``after``. (Fresh when there is
  no previous listing, or when it was cut at a later ``after`` and so cannot tell.)
- ``latency``: every operation first sleeps a uniform random time in ``[0, latency]``
  seconds on the injected clock.

Invalid keys raise ``ValueError`` before any fault is drawn, exactly as without the
wrapper. Draws come from one ``random.Random(seed)`` behind a lock, in the order operations
start: a sequential run is reproducible from its seed, a concurrent one from its seed and
its interleaving. ``counts`` tells how many of each fault were injected.
"""

import math
import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from types import TracebackType
from typing import Self

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox._base import (
    Mailbox,
    RangedMailbox,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
)

__all__ = ["FaultCounts", "Faults", "FaultyMailbox"]

_REMEMBERED_PREFIXES = 1024


@dataclass(frozen=True)
class Faults:
    """The probability of each fault per operation (0 to 1), and the most latency added."""

    unavailable: float = 0.0
    conflict: float = 0.0
    lost_reply: float = 0.0
    stale_list: float = 0.0
    latency: float = 0.0

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "latency":
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"latency must be finite seconds >= 0, not {value!r}")
            elif not 0.0 <= value <= 1.0:
                raise ValueError(f"{spec.name} is a probability in [0, 1], not {value!r}")

    @classmethod
    def uniform(cls, rate: float, *, latency: float = 0.0) -> "Faults":
        """Every kind of fault with probability ``rate``."""
        return cls(
            unavailable=rate, conflict=rate, lost_reply=rate, stale_list=rate, latency=latency
        )


@dataclass(frozen=True)
class FaultCounts:
    """How many operations ran and how many of each fault were injected."""

    operations: int = 0
    unavailable: int = 0
    conflict: int = 0
    lost_reply: int = 0
    stale_list: int = 0
    delayed: int = 0

    @property
    def total(self) -> int:
        """Faults injected, not counting added latency."""
        return self.unavailable + self.conflict + self.lost_reply + self.stale_list

    def plus(self, **more: int) -> "FaultCounts":
        return replace(self, **{name: getattr(self, name) + n for name, n in more.items()})


@dataclass(frozen=True)
class _Draw:
    delay: float
    unavailable: bool
    conflict: bool
    lost_reply: bool
    stale_list: bool


class FaultyMailbox:
    """Wraps ``inner`` (entered and left with it) and injects ``faults``; see the module.

    Safe to use from several tasks, event loops and threads as far as ``inner`` is.
    Cancellation behaves as ``inner``'s, plus a cancellable sleep for added latency.
    """

    def __init__(
        self,
        inner: Mailbox,
        faults: Faults,
        *,
        seed: int = 0,
        clock: Clock | None = None,
    ) -> None:
        self._inner = inner
        self._faults = faults
        self._random = random.Random(seed)
        self._clock = clock if clock is not None else MonotonicClock()
        self._lock = threading.Lock()
        self._counts = FaultCounts()
        # prefix -> (after, keys) of its latest fresh listing, the oldest prefix first.
        self._listings: dict[str, tuple[str, Sequence[str]]] = {}

    @property
    def inner(self) -> Mailbox:
        return self._inner

    @property
    def counts(self) -> FaultCounts:
        with self._lock:
            return self._counts

    def _draw(self) -> _Draw:
        faults = self._faults
        with self._lock:
            chance = self._random.random
            draw = _Draw(
                delay=chance() * faults.latency,
                unavailable=chance() < faults.unavailable,
                conflict=chance() < faults.conflict,
                lost_reply=chance() < faults.lost_reply,
                stale_list=chance() < faults.stale_list,
            )
            self._counts = self._counts.plus(operations=1, delayed=int(draw.delay > 0))
        return draw

    def _count(self, fault: str) -> None:
        with self._lock:
            self._counts = self._counts.plus(**{fault: 1})

    async def _start(self, operation: str) -> _Draw:
        draw = self._draw()
        if draw.delay > 0:
            await self._clock.sleep(draw.delay)
        if draw.unavailable:
            self._count("unavailable")
            raise MailboxUnavailable(f"injected fault: {operation} found the store unavailable")
        return draw

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        draw = await self._start(f"put {key!r}")
        if draw.conflict:
            self._count("conflict")
            raise MailboxUnavailable(f"injected fault: put {key!r} conflicted three times")
        created = await self._inner.put_if_absent(key, data)
        if created and draw.lost_reply:
            self._count("lost_reply")
            raise MailboxUnavailable(f"injected fault: the reply to put {key!r} was lost")
        return created

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        check_key(key)
        check_max_bytes(max_bytes)
        await self._start(f"get {key!r}")
        return await self._inner.get(key, max_bytes=max_bytes)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """``inner``'s ``get_range`` with the faults of a ``get``; an inner mailbox without
        one answers from its ``get``."""
        check_key(key)
        check_range(start, end)
        await self._start(f"get {key!r} [{start}, {end})")
        if isinstance(self._inner, RangedMailbox):
            return await self._inner.get_range(key, start, end)
        data = await self._inner.get(key)
        return None if data is None else data[start:end]

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        draw = await self._start(f"list {prefix!r}")
        fresh = await self._inner.list(prefix, after=after)
        with self._lock:
            previous = self._listings.pop(prefix, None)
            self._listings[prefix] = (after, fresh)
            if len(self._listings) > _REMEMBERED_PREFIXES:
                del self._listings[next(iter(self._listings))]
            if draw.stale_list and previous is not None and previous[0] <= after:
                self._counts = self._counts.plus(stale_list=1)
                return [key for key in previous[1] if key > after]
        return fresh

    async def delete(self, keys: Iterable[str]) -> None:
        checked = [check_key(key) for key in keys]
        await self._start(f"delete {len(checked)} keys")
        await self._inner.delete(checked)

    async def __aenter__(self) -> Self:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._inner.__aexit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"FaultyMailbox({self._inner!r}, {self._faults}, {self.counts})"
