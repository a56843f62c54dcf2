"""A directory as a mailbox: the embedded default for one machine or a shared POSIX filesystem.

Objects are files under ``directory/objects/``; ``tmp/`` holds objects being written and is
never part of the key space. ``key_path`` and ``key_of`` map every valid key (``check_key``)
one-to-one to a path below ``objects/`` and back: segments become directories and the object
a file named after its last segment with ``%`` appended (``%`` escaped as ``%25``; segments
over 240 bytes cut into ``…%+`` directories; a bare ``.`` or ``..`` piece written ``%.``,
``%..``).

``put_if_absent`` writes a fresh file in ``tmp/`` and ``os.link``s it into place: creation is
atomic across threads and processes, and no reader sees a partial object. ``list`` reads
directory entries only and returns keys in UTF-8 byte order. With ``durable=True`` a created
object survives a power loss. Every operation runs in a worker thread; cancellation waits
for its operation (for an object over 16 MiB, its current chunk) to finish, so a cancelled
``put_if_absent`` has created its object or not. The filesystem must support hard links and
be case-sensitive (``__aenter__`` checks the latter).

An ``OSError`` the device may not repeat (``EIO``, ``ESTALE``, ``ETIMEDOUT``, a network
error) becomes ``MailboxUnavailable``; one only the operator can fix (``ENOSPC``,
``EDQUOT``, ``EROFS``, ``EACCES``/``EPERM``) ``LocalAccessError``, an ``OSError`` with the
same ``errno`` naming the directory; both chain the original, and any other ``OSError`` (a
caller's bug) propagates unchanged. The rest: docs/mailbox.md, "LocalMailbox".
"""

import builtins
import contextlib
import errno
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio.lowlevel
import anyio.to_thread

from gradientmail.errors import MailboxUnavailable, StoreAccessError
from gradientmail.mailbox import _local_writes
from gradientmail.mailbox._base import check_key, check_max_bytes, check_prefix, check_range
from gradientmail.mailbox._local_layout import key_of, key_path
from gradientmail.mailbox._local_listing import list_local_keys
from gradientmail.mailbox._local_reads import open_for_range, read_in_chunks, read_object
from gradientmail.mailbox._local_writes import Writer

__all__ = ["LocalAccessError", "LocalMailbox", "key_of", "key_path"]

_OBJECTS = "objects"
_TMP = "tmp"
_STALE_TEMP_SECONDS = 3600.0


def _errnos(*names: str) -> frozenset[int]:
    """The numbers of the errno ``names`` this platform defines."""
    return frozenset(getattr(errno, name) for name in names if hasattr(errno, name))


_TRANSIENT_ERRNOS = _errnos(
    # The device or the file server failed this request; the next may succeed (a disk
    # retrying a sector, an NFS server restarting and its handles going stale).
    "EIO",
    "ESTALE",
    "EREMOTEIO",
    "ETIMEDOUT",
    "EAGAIN",
    "EBUSY",
    "EINTR",
    "ENOLCK",
    "ECOMM",
    # The network under a network filesystem.
    "ECONNRESET",
    "ECONNABORTED",
    "ECONNREFUSED",
    "ENOTCONN",
    "ENETDOWN",
    "ENETRESET",
    "ENETUNREACH",
    "EHOSTDOWN",
    "EHOSTUNREACH",
)
_FULL = "free space on its filesystem, or move the run to a larger one"
_ADVICE = {
    **dict.fromkeys(_errnos("ENOSPC"), _FULL),
    **dict.fromkeys(_errnos("EDQUOT"), "raise this user's disk quota or free space within it"),
    **dict.fromkeys(_errnos("EROFS"), "remount its filesystem read-write or use another directory"),
    **dict.fromkeys(
        _errnos("EACCES", "EPERM"),
        "give this user permission to read, write and create files and directories in it",
    ),
}
"""The errors only the operator can fix, and what to do about each."""


class LocalAccessError(OSError, StoreAccessError):
    """The filesystem refused an operation for a reason only the operator can fix: it is
    full, over quota, read-only, or denies this user (the errnos in ``_ADVICE``).

    A ``StoreAccessError`` (the node fails at once) and an ``OSError`` with the original's
    ``errno`` and ``filename``, so callers catching ``OSError`` or reading ``errno`` keep
    working; its ``strerror`` adds the mailbox's directory, the operation and what to do.
    ``LocalMailbox`` raises it with the original chained; nothing transient, so nothing
    retries it.
    """


class LocalMailbox:
    """Objects as files under ``directory``; see the module docstring for the layout.

    Construction does no I/O. Operations work whether or not the mailbox has been entered;
    entering creates the directory, checks that the filesystem is case-sensitive (raising
    ``OSError`` if not) and removes stale temporary files. Leaving does nothing: no thread
    or handle outlives an operation. One instance may be used from several event loops and
    threads at once, and any number of processes may share the directory.
    """

    def __init__(self, directory: str | os.PathLike[str], *, durable: bool = False) -> None:
        self._root = Path(directory)
        self._objects = self._root / _OBJECTS
        self._tmp = self._root / _TMP
        self._durable = durable
        self._writer = Writer(self._objects, self._tmp, durable)

    @property
    def directory(self) -> Path:
        return self._root

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        with self._boundary(f"put {key!r}"):
            if len(data) > _local_writes.WRITE_CHUNK:
                return await self._writer.put_in_chunks(key_path(key), data)
            return await anyio.to_thread.run_sync(self._put, key_path(key), data)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        check_key(key)
        check_max_bytes(max_bytes)
        with self._boundary(f"get {key!r}"):
            # Shielded so that a file it opened is never lost to a cancellation arriving as
            # the thread returns (cancellation waits for the thread either way).
            with anyio.CancelScope(shield=True):
                got = await anyio.to_thread.run_sync(self._get, key, key_path(key), max_bytes)
            if not isinstance(got, tuple):
                await anyio.lowlevel.checkpoint_if_cancelled()
                return got
            fd, size = got
            try:
                return await read_in_chunks(fd, size)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(os.close, fd)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_key(key)
        check_range(start, end)
        with self._boundary(f"get {key!r} [{start}, {end})"):
            with anyio.CancelScope(shield=True):
                got = await anyio.to_thread.run_sync(self._get_range, key, key_path(key))
            if got is None:
                await anyio.lowlevel.checkpoint_if_cancelled()
                return None
            try:
                return await read_in_chunks(got, end - start, offset=start)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(os.close, got)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        with self._boundary(f"list {prefix!r}"):
            return await anyio.to_thread.run_sync(self._list, prefix, after)

    async def delete(self, keys: Iterable[str]) -> None:
        paths = [key_path(check_key(key)) for key in keys]
        if paths:
            with self._boundary(f"delete {len(paths)} keys"):
                await anyio.to_thread.run_sync(self._delete, paths)

    async def __aenter__(self) -> Self:
        with self._boundary("open"):
            await anyio.to_thread.run_sync(self._prepare)
        return self

    @contextlib.contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Translate an ``OSError`` escaping the block: a transient one (``_TRANSIENT_ERRNOS``)
        to ``MailboxUnavailable``, the operator's (``_ADVICE``) to ``LocalAccessError``, both
        chaining the original; any other propagates unchanged."""
        try:
            yield
        except OSError as error:
            if isinstance(error, LocalAccessError):
                raise
            if error.errno in _TRANSIENT_ERRNOS:
                raise MailboxUnavailable(f"{self!r}: {what}: {error}") from error
            if error.errno in _ADVICE:
                explained = (
                    f"{error.strerror} in mailbox directory {str(self._root)!r} ({what}): "
                    f"{_ADVICE[error.errno]}"
                )
                raise LocalAccessError(error.errno, explained, error.filename) from error
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def __repr__(self) -> str:
        return f"LocalMailbox({str(self._root)!r}, durable={self._durable})"

    def _prepare(self) -> None:
        self._objects.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        probe = self._tmp / f"case-{uuid.uuid4().hex}"
        probe.touch()
        try:
            if (self._tmp / probe.name.upper()).exists():
                raise OSError(
                    f"{self._root} is on a case-insensitive filesystem, where keys that "
                    "differ only in case would collide; use a case-sensitive one"
                )
        finally:
            probe.unlink()
        cutoff = time.time() - _STALE_TEMP_SECONDS
        for entry in os.scandir(self._tmp):
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue

    def _put(self, names: tuple[str, ...], data: bytes) -> bool:
        return self._writer.put(names, data)

    def _get(
        self, key: str, names: tuple[str, ...], max_bytes: int | None
    ) -> bytes | tuple[int, int] | None:
        return read_object(self._objects, key, names, max_bytes)

    def _get_range(self, key: str, names: tuple[str, ...]) -> int | None:
        return open_for_range(self._objects, key, names)

    def _list(self, prefix: str, after: str) -> builtins.list[str]:
        return list_local_keys(self._objects, prefix, after)

    def _delete(self, paths: builtins.list[tuple[str, ...]]) -> None:
        self._writer.delete(paths)
