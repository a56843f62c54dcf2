"""Test helpers for the patterns: a clock that does not make tests wait, and a store whose
faults are injected around a real MemoryMailbox."""

import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Self

import anyio

from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox import MemoryMailbox


class QuickClock:
    """Real monotonic time, but every sleep is cut to a millisecond; records what was asked."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await anyio.sleep(min(seconds, 0.001))


Fault = Callable[[str, str], BaseException | None]
"""Given (operation, key or prefix), the exception to raise instead of answering, or None."""


class FaultyMailbox:
    """A MemoryMailbox whose operations first consult ``fault``.

    With ``lose_reply`` a faulted ``put_if_absent`` first performs the write and then raises,
    as when a store creates the object and the reply is lost on the way back.
    """

    def __init__(self, fault: Fault, *, lose_reply: bool = False) -> None:
        self.inner = MemoryMailbox()
        self.fault = fault
        self.lose_reply = lose_reply
        self.calls: list[tuple[str, str]] = []

    def _check(self, operation: str, key: str) -> None:
        self.calls.append((operation, key))
        exc = self.fault(operation, key)
        if exc is not None:
            raise exc

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.lose_reply:
            created = await self.inner.put_if_absent(key, data)
            self._check("put_if_absent", key)
            return created
        self._check("put_if_absent", key)
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._check("get", key)
        return await self.inner.get(key, max_bytes=max_bytes)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self._check("list", prefix)
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._check("delete", key)
        await self.inner.delete(keys)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


def first(n: int, operation: str, exc: Callable[[], BaseException]) -> Fault:
    """A fault that raises ``exc()`` on the first ``n`` calls of ``operation``."""
    seen = 0

    def fault(op: str, key: str) -> BaseException | None:
        nonlocal seen
        if op != operation or seen >= n:
            return None
        seen += 1
        return exc()

    return fault


def unavailable() -> BaseException:
    return MailboxUnavailable("injected: connection reset")


async def listed(mailbox: MemoryMailbox, prefix: str, count: int, seconds: float = 10.0) -> None:
    """Wait until ``mailbox`` holds ``count`` keys under ``prefix``."""
    with anyio.fail_after(seconds):
        # Polled: the store is what other nodes share, and it notifies nobody.
        while len(await mailbox.list(prefix)) != count:  # noqa: ASYNC110
            await anyio.sleep(0.005)


async def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait until ``condition()`` holds, failing the test after ``seconds``."""
    with anyio.fail_after(seconds):
        # Polled: the conditions are set by worker threads and other processes, which
        # cannot set an anyio.Event.
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.005)
