"""The requests one store makes of its mailbox: retried, counted, and create-once writes
settled.

Every operation retries ``MailboxUnavailable`` with backoff (``mailbox.retrying``) on the
node's clock, up to ``max_retry_delay`` between tries, for ``attempts`` tries (None: until it
succeeds or is cancelled); every other error propagates at once. Requests are counted by kind
and the bytes moved are summed, for ``Store.stats``.

Runs in the node's tasks on the event loop. Cancellation interrupts the request in progress;
a cancelled create-once write may or may not have landed (the caller's next read tells).
"""

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox import Mailbox, RangedMailbox, retrying

__all__ = ["Requests", "StoreStats"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What one store has moved: bytes written and read, and requests by kind (``put``,
    ``get``, ``list``, ``delete``; retries included)."""

    bytes_up: int = 0
    bytes_down: int = 0
    requests: Mapping[str, int] = field(default_factory=dict)


class Requests:
    """Retried, counted requests to ``mailbox`` (see the module docstring). It does not own
    the mailbox: whoever opened it closes it."""

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        clock: Clock | None = None,
        max_retry_delay: float = 30.0,
        attempts: int | None = None,
    ) -> None:
        self.mailbox = mailbox
        self.clock = clock if clock is not None else MonotonicClock()
        self._max_delay = max_retry_delay
        self._attempts = attempts
        self._bytes_up = 0
        self._bytes_down = 0
        self._requests = {"put": 0, "get": 0, "list": 0, "delete": 0}

    @property
    def stats(self) -> StoreStats:
        return StoreStats(
            bytes_up=self._bytes_up, bytes_down=self._bytes_down, requests=dict(self._requests)
        )

    def __repr__(self) -> str:
        return (
            f"Requests({self.mailbox!r}, up={self._bytes_up}, down={self._bytes_down}, "
            f"requests={self._requests})"
        )

    async def _retry(self, op: Callable[[], Awaitable[T]], attempts: int | None) -> T:
        return await retrying(
            op,
            clock=self.clock,
            max_delay=self._max_delay,
            attempts=attempts if attempts is not None else self._attempts,
        )

    async def get(
        self, key: str, *, attempts: int | None = None, max_bytes: int | None = None
    ) -> bytes | None:
        """The bytes under ``key`` or None; ``ObjectRefused`` (a ``RecordError``) for an
        object over ``max_bytes`` or one the mailbox will not read, before its body is read."""

        async def op() -> bytes | None:
            self._requests["get"] += 1
            data = await self.mailbox.get(key, max_bytes=max_bytes)
            if data is not None:
                self._bytes_down += len(data)
            return data

        return await self._retry(op, attempts)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of ``key`` (``RangedMailbox.get_range``), or None; a
        mailbox without ranged reads answers from a whole ``get``. Retried and counted as
        ``get`` is."""

        async def op() -> bytes | None:
            self._requests["get"] += 1
            if isinstance(self.mailbox, RangedMailbox):
                data = await self.mailbox.get_range(key, start, end)
            else:
                whole = await self.mailbox.get(key)
                data = None if whole is None else whole[start:end]
            if data is not None:
                self._bytes_down += len(data)
            return data

        return await self._retry(op, None)

    async def list_keys(
        self, prefix: str, *, after: str = "", attempts: int | None = None
    ) -> Sequence[str]:
        """Every key under ``prefix`` after ``after``, in byte order."""

        async def op() -> Sequence[str]:
            self._requests["list"] += 1
            return await self.mailbox.list(prefix, after=after)

        return await self._retry(op, attempts)

    async def delete(self, keys_: Iterable[str], *, attempts: int | None = None) -> None:
        """Remove ``keys_`` (missing ones are fine)."""
        batch = list(keys_)
        if not batch:
            return

        async def op() -> None:
            self._requests["delete"] += 1
            await self.mailbox.delete(batch)

        await self._retry(op, attempts)

    async def create(
        self, key: str, data: bytes, *, attempts: int | None = None, read_back: bool = True
    ) -> bool:
        """Create ``key`` holding ``data``; True iff the object now there is this write's.

        When a try failed transiently (its object may have landed) and a later try finds the
        key taken, the object is read back (unless ``read_back`` is False): equal bytes mean
        the lost try created it.
        """
        ambiguous = False

        async def op() -> bool:
            nonlocal ambiguous
            self._requests["put"] += 1
            try:
                created = await self.mailbox.put_if_absent(key, data)
            except MailboxUnavailable:
                ambiguous = True
                raise
            if created:
                self._bytes_up += len(data)
            return created

        if await self._retry(op, attempts):
            return True
        if not ambiguous or not read_back:
            return False
        return await self.get(key, attempts=attempts) == data
