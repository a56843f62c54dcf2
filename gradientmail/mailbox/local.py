"""A directory as a mailbox: the embedded default for one machine or a shared POSIX filesystem.

On-disk layout
--------------
Under the mailbox's ``directory``::

    objects/   the key space: one file per object
    tmp/       objects being written; never part of the key space

A key's ``/``-separated segments become nested directory names, and the object itself is a
file named after its last segment with ``%`` appended. Inside every name ``%`` is escaped as
``%25``, so an escaped segment never ends in a bare ``%``: a file and a directory can never
share a name, and ``a`` and ``a/b`` are both storable (``objects/a%`` and ``objects/a/b%``).
A segment longer than 240 UTF-8 bytes (most filesystems cap a name at 255) is cut into
pieces, each but the last a directory whose name ends in ``%+``; a last piece that is ``.``
or ``..`` (of a segment that is not the key's last) is written ``%.`` or ``%..``, names no
escaped piece can have (its every ``%`` is followed by ``25``). Keys are thereby any valid
key (``check_key``), map one-to-one to paths below ``objects/`` and decode back exactly;
``key_path`` and ``key_of`` are that mapping.

Guarantees
----------
``put_if_absent`` writes the bytes to a fresh file in ``tmp/`` and hard-links it into
place with ``os.link``, which fails with ``EEXIST`` when the object already exists: creation
is atomic across threads and processes (the loser gets False) and a reader never sees a
partial object. ``list`` reads directory entries only (never a file): their names, told
apart by the marks above, and an entry's type only where a directory's link count cannot
prove that no object-named entry is a directory. It starts in the directory of the prefix's
whole segments, prunes subtrees that cannot match the prefix or lie wholly at or before
``after``, never follows a symbolic link to a directory, skips entries the layout never
makes (a directory named like an object, a file named like a directory, a name that is not
UTF-8), and returns keys in UTF-8 byte order. ``delete`` unlinks and then removes the
directories it emptied; a concurrent ``put_if_absent`` whose directory vanished under it
recreates it and tries again.

With ``durable=True`` the object's bytes, its directory entry and every directory created
for it are fsynced before ``put_if_absent`` returns (and directory entries after
``delete``), so a created object survives a power loss; without it, a crash of the machine
(not of the process) may lose recent objects.

Every operation runs in one worker thread (``anyio.to_thread.run_sync``), never on the event
loop. Cancellation waits for that thread to finish its operation, so a cancelled
``put_if_absent`` has either created its object or not, and the caller reads it back. An
object over 16 MiB is written in 16 MiB chunks, one worker-thread call each, straight from
the caller's bytes (no copy); cancellation between chunks removes the partial temporary
file. ``get`` reads such an object in 16 MiB chunks too, one worker-thread call each,
straight into the ``bytes`` it returns (``_bytes.Filling``: no second whole-object buffer);
cancellation between chunks closes the file and drops what was read. A smaller object is
opened, checked and read in one worker-thread call.

The filesystem must support hard links and be case-sensitive (``__aenter__`` checks the
latter): Linux ext4, xfs, btrfs, zfs and NFSv3+ qualify; macOS's default case-insensitive
APFS does not. Temporary files left behind by a killed process are removed by the next
``__aenter__`` once they are an hour old.

Failure modes
-------------
An ``OSError`` that the device or the file server may not repeat (``EIO``, a stale NFS
handle ``ESTALE``, ``ETIMEDOUT``, ``EAGAIN``, a network error under a network filesystem:
``_TRANSIENT_ERRNOS``) becomes ``MailboxUnavailable``, which callers retry. One only the
operator can fix (a full disk ``ENOSPC``, ``EDQUOT``, a read-only filesystem ``EROFS``,
``EACCES``/``EPERM``) becomes ``LocalAccessError``, an ``OSError`` with the same ``errno``
whose message names the directory and says what to do. Both chain the original; any other
``OSError`` (a caller's bug) propagates unchanged.
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
from gradientmail.mailbox._local_listing import list_keys
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
        return list_keys(self._objects, prefix, after)

    def _delete(self, paths: builtins.list[tuple[str, ...]]) -> None:
        self._writer.delete(paths)
