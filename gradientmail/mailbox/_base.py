"""The transport contract: four operations over immutable, create-once objects.

An object is written at most once (``put_if_absent``), read back by key (``get``), discovered
by prefix in UTF-8 byte order (``list``) and removed idempotently (``delete``). Nothing here
knows about rounds or snapshots; ``gradientmail.protocol`` lays the run out on top.
"""

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Protocol, Self, TypeVar, runtime_checkable

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.errors import MailboxUnavailable, RecordError

__all__ = [
    "MAX_KEY_BYTES",
    "Mailbox",
    "NotARegularFile",
    "ObjectRefused",
    "ObjectTooLarge",
    "RangedMailbox",
    "check_key",
    "check_max_bytes",
    "check_prefix",
    "check_range",
    "retrying",
]

MAX_KEY_BYTES = 1024
"""The longest key (in UTF-8 bytes) every backend accepts; S3's own limit."""

_log = logging.getLogger("gradientmail.mailbox")

T = TypeVar("T")


class ObjectRefused(RecordError):
    """``get`` found an object at the key but will not read it: what is there cannot be a
    well-formed object of the run (its writer was broken or hostile). The caller treats the
    key as holding a malformed object; nothing was read into memory."""


class ObjectTooLarge(ObjectRefused):
    """The object is larger than the ``max_bytes`` its reader allowed; its size was learnt
    before its body was read (``size``: the bytes the store reports, or a lower bound)."""

    def __init__(self, key: str, size: int, max_bytes: int) -> None:
        super().__init__(
            f"object {key!r} holds {size} bytes, more than the {max_bytes} allowed for it; "
            "it was not read"
        )
        self.key = key
        self.size = size
        self.max_bytes = max_bytes

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.key, self.size, self.max_bytes)


class NotARegularFile(ObjectRefused):
    """(``LocalMailbox``) The entry at the key is a symbolic link, a device, a FIFO or a
    socket, never something the mailbox writes; it is neither followed nor read."""


def check_max_bytes(max_bytes: int | None) -> int | None:
    """Return ``max_bytes`` if it is None or a non-negative int, else raise ``ValueError``."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be None or a number of bytes >= 0, not {max_bytes!r}")
    return max_bytes


@runtime_checkable
class Mailbox(Protocol):
    """What every backend provides. Each operation is a cancellation point; a cancelled
    ``put_if_absent`` may or may not have created its object (the caller reads it back).

    A mailbox is an async context manager: entering opens its connections (if any), leaving
    closes them and leaves no task, connection or thread behind. Keys are checked by
    ``check_key`` on every backend alike before any I/O.
    """

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data``; True iff this call created it.

        An existing object is left untouched and False is returned.
        """
        ...

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The bytes under ``key``, or None when no such object exists.

        With ``max_bytes``, an object larger than that raises ``ObjectTooLarge`` before its
        body is read (the size comes from the store's metadata, and no more than
        ``max_bytes`` are ever read). An entry that cannot be an object (``LocalMailbox``:
        a symbolic link or anything but a regular file) raises ``NotARegularFile``.
        """
        ...

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        """Every key under ``prefix`` greater than ``after``, in UTF-8 byte order, all pages."""
        ...

    async def delete(self, keys: Iterable[str]) -> None:
        """Remove ``keys`` in any number; missing keys are not an error."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class RangedMailbox(Mailbox, Protocol):
    """A mailbox that also reads part of an object (every built-in backend does). The store
    reads a blob's ranges through ``get_range`` when its mailbox has it, else the whole
    object through ``get`` and keeps the ranges: correct, with no saving of bandwidth."""

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the object under ``key`` (fewer when the object ends
        before ``end``; empty when it ends at or before ``start``), or None when no such
        object exists. Raises ``ValueError`` for a range that is not ``0 <= start < end``
        (``check_range``), and ``NotARegularFile`` as ``get`` does."""
        ...


def check_range(start: int, end: int) -> None:
    """Raise ``ValueError`` unless ``0 <= start < end`` (ints)."""
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
        raise ValueError(f"a byte range needs 0 <= start < end, got [{start!r}, {end!r})")


def _problem(key: str) -> str | None:
    if not key:
        return "a key must not be empty"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"a key must be at most {MAX_KEY_BYTES} UTF-8 bytes"
    if "\x00" in key:
        return "a key must not contain NUL"
    if "\\" in key:
        return "a key must not contain a backslash"
    if key.startswith("/"):
        return "a key must not start with '/'"
    for segment in key.split("/"):
        if not segment:
            return "a key's '/'-separated segments must not be empty"
        if segment in (".", ".."):
            return "a key must not have a '.' or '..' segment"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "a key must be valid UTF-8 (no lone surrogates)"
    return None


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise ``ValueError`` naming the rule.

    Valid: non-empty ``/``-separated segments, none of them ``.`` or ``..``, no leading
    ``/``, no NUL or backslash, at most 1024 UTF-8 bytes.
    """
    problem = _problem(key)
    if problem is not None:
        raise ValueError(f"invalid mailbox key {key!r}: {problem}")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is empty or a valid key with an optional trailing ``/``."""
    if prefix:
        problem = _problem(prefix.removesuffix("/"))
        if problem is not None:
            raise ValueError(f"invalid mailbox prefix {prefix!r}: {problem}")
    return prefix


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    clock: Clock | None = None,
    max_delay: float = 30.0,
    attempts: int | None = None,
) -> T:
    """Run ``op`` until it returns, sleeping on ``clock`` after each ``MailboxUnavailable``.

    Delays start at 0.5 s (or ``max_delay`` if smaller) and double up to ``max_delay``. Any
    other exception propagates at once. With ``attempts``, the last ``MailboxUnavailable``
    propagates after that many tries. Cancellation interrupts the sleep or the operation and
    propagates. Raises ``ValueError`` for a ``max_delay`` that is not positive or an
    ``attempts`` below 1.
    """
    if not max_delay > 0:
        raise ValueError(f"max_delay must be a positive number of seconds, not {max_delay!r}")
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be at least 1 (or None for no limit), not {attempts!r}")
    clock = clock if clock is not None else MonotonicClock()
    delay = min(0.5, max_delay)
    tries = 0
    while True:
        tries += 1
        try:
            return await op()
        except MailboxUnavailable as exc:
            if attempts is not None and tries >= attempts:
                raise
            _log.warning("mailbox unavailable (%s); retrying in %.1f s", exc, delay)
            await clock.sleep(delay)
            delay = min(delay * 2, max_delay)
