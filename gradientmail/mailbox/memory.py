"""An in-memory mailbox for tests and single-process runs."""

import threading
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Self

from gradientmail.mailbox._base import (
    ObjectTooLarge,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
)

__all__ = ["MemoryMailbox"]


class MemoryMailbox:
    """A dict behind a ``threading.Lock``.

    The lock is not an asyncio or trio primitive because one instance may be shared between
    event loops running on different threads. Operations never block on I/O, but each is
    still a checkpoint-free coroutine: callers that poll it in a loop sleep between polls.
    Entering and leaving it as a context manager is allowed and does nothing; the objects
    survive, so one instance can serve several nodes in turn.
    """

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = bytes(data)
            return True

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        check_key(key)
        check_max_bytes(max_bytes)
        with self._lock:
            data = self._objects.get(key)
        if data is not None and max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLarge(key, len(data), max_bytes)
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_key(key)
        check_range(start, end)
        with self._lock:
            data = self._objects.get(key)
        return None if data is None else data[start:end]

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        # Code point order is UTF-8 byte order, so str comparison matches S3's listing order.
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix) and k > after)

    async def delete(self, keys: Iterable[str]) -> None:
        keys = [check_key(key) for key in keys]
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def __repr__(self) -> str:
        with self._lock:
            return f"MemoryMailbox(objects={len(self._objects)})"
