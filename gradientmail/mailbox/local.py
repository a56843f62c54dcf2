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
import stat
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio.lowlevel
import anyio.to_thread

from gradientmail._bytes import Filling
from gradientmail.errors import MailboxUnavailable, StoreAccessError
from gradientmail.mailbox._base import (
    NotARegularFile,
    ObjectTooLarge,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
)

__all__ = ["LocalAccessError", "LocalMailbox", "key_of", "key_path"]

_OBJECTS = "objects"
_TMP = "tmp"
_PIECE_BYTES = 240
_FILE_MARK = "%"
_MORE_MARK = "%+"
_DOT_MARK = "%"
_DOT_NAMES = (_DOT_MARK + ".", _DOT_MARK + "..")
_STALE_TEMP_SECONDS = 3600.0
_SUBDIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# Never through a symbolic link; never waiting for a FIFO's writer (non-blocking changes
# nothing for a regular file).
_OBJECT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
# The most one read(2) returns on Linux.
_READ_CHUNK = 0x7FFFF000
# A put whose parent directory is removed by a concurrent delete retries; this bounds a
# pathological livelock, not any expected case.
_PUT_ATTEMPTS = 100
_RACE_CHECK_BYTES = 1 << 16
# Objects larger than this are written in chunks this size, one worker-thread call each.
_WRITE_CHUNK = 16 << 20
# Objects larger than this are read in chunks this size, one worker-thread call each.
_READ_CHUNK_BYTES = 16 << 20


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


def _escape(text: str) -> str:
    return text.replace("%", "%25")


def _unescape(text: str) -> str:
    return text.replace("%25", "%")


def _pieces(segment: str) -> list[str]:
    """``segment`` escaped and cut, at character boundaries, into names of bounded length."""
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for char in segment:
        escaped = _escape(char)
        width = len(escaped.encode("utf-8"))
        if size + width > _PIECE_BYTES:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(escaped)
        size += width
    pieces.append("".join(current))
    return pieces


def _directory_name(piece: str) -> str:
    """The directory name of a segment's last piece: the piece itself, unless it is ``.``
    or ``..`` (a long segment's tail can be), which would name this directory or its
    parent; those get the dot mark: ``%.`` and ``%..`` are no escaped piece, in which a
    ``%`` is always followed by ``25``."""
    return _DOT_MARK + piece if piece in (".", "..") else piece


def key_path(key: str) -> tuple[str, ...]:
    """The names, relative to ``objects/``, of the file that holds ``key`` (already checked).

    One-to-one: distinct keys get distinct names, none of them empty, ``.`` or ``..``, so
    every path stays below ``objects/``.
    """
    names: list[str] = []
    segments = key.split("/")
    for index, segment in enumerate(segments):
        pieces = _pieces(segment)
        names.extend(piece + _MORE_MARK for piece in pieces[:-1])
        last = index == len(segments) - 1
        names.append(pieces[-1] + _FILE_MARK if last else _directory_name(pieces[-1]))
    return tuple(names)


def _partial(key_so_far: str, name: str, *, is_file: bool) -> str | None:
    """The key text that a directory entry ``name`` adds; None for an entry that is not ours.

    A directory's text ends in ``/`` unless it is a piece of a longer segment; a file's text
    completes a key.
    """
    if is_file:
        if not name.endswith(_FILE_MARK):
            return None
        return key_so_far + _unescape(name[: -len(_FILE_MARK)])
    if name.endswith(_MORE_MARK):
        return key_so_far + _unescape(name[: -len(_MORE_MARK)])
    if name.endswith(_FILE_MARK):
        return None
    if name in _DOT_NAMES:
        return key_so_far + name[len(_DOT_MARK) :] + "/"
    return key_so_far + _unescape(name) + "/"


def key_of(names: Sequence[str]) -> str:
    """The key that ``key_path`` mapped to ``names``: its inverse."""
    key = ""
    for name in names[:-1]:
        partial = _partial(key, name, is_file=False)
        if partial is None:
            raise ValueError(f"{'/'.join(names)!r} is not an object path")
        key = partial
    partial = _partial(key, names[-1], is_file=True)
    if partial is None:
        raise ValueError(f"{'/'.join(names)!r} is not an object path")
    return partial


def _may_hold(partial: str, prefix: str, after: str) -> bool:
    """Whether a directory whose keys all start with ``partial`` can hold a key to list."""
    if not (partial.startswith(prefix) or prefix.startswith(partial)):
        return False
    # Every key under ``partial`` sorts before ``after`` when they differ within ``partial``.
    return not (partial < after and not after.startswith(partial))


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _joined(names: list[str]) -> str:
    """``names``, each followed by a NUL (which no name holds), as one string."""
    return "\0".join(names) + "\0"


def _by_name(names: list[str]) -> tuple[list[str], list[str]]:
    """``names`` split into files and directories by the layout's marks alone."""
    if _joined(names).count(_FILE_MARK + "\0") == len(names):
        return names, []
    files = [name for name in names if name.endswith(_FILE_MARK)]
    directories = [name for name in names if not name.endswith(_FILE_MARK)]
    return files, directories


def _typed_files(directory: int) -> list[str]:
    """The names in ``directory`` that end in the file mark and are not directories, by
    each entry's type (``d_type``, no ``stat`` where the filesystem provides it)."""
    files: list[str] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.endswith(_FILE_MARK):
                continue
            try:
                if not entry.is_dir(follow_symlinks=False):
                    files.append(entry.name)
            except FileNotFoundError:
                continue
    return files


def _file_keys(files: list[str], key_so_far: str, prefix: str, after: str) -> list[str]:
    """The keys of the objects named ``files`` (each ending in the mark) in the directory
    whose keys start with ``key_so_far``, less those that do not match ``prefix`` and
    ``after``; unsorted."""
    if not files:
        return []
    joined = _joined(files)
    if joined.count(_FILE_MARK) == len(files):
        # No name holds an escape: one replace and one split build every key.
        keys = (key_so_far + joined.replace(_FILE_MARK + "\0", "\0" + key_so_far)).split("\0")
        # What follows the last NUL: ``key_so_far`` alone.
        keys.pop()
    else:
        keys = [key_so_far + _unescape(name[: -len(_FILE_MARK)]) for name in files]
    if key_so_far.startswith(prefix) and key_so_far > after:
        # Every key here extends ``key_so_far``, so every key matches.
        return keys
    return [key for key in keys if key.startswith(prefix) and key > after]


def _open_subdirectory(directory: int, name: str) -> int | None:
    """``name`` in the open ``directory``, opened; None if it is missing or is not a
    directory (a symbolic link is not)."""
    try:
        return os.open(name, _SUBDIRECTORY, dir_fd=directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        return None


def _walk(directory: int, key_so_far: str, prefix: str, after: str, keys: list[str]) -> None:
    """Append to ``keys`` those under the open ``directory`` that match ``prefix`` and
    ``after``, where every key starts with ``key_so_far``.

    The names come from ``os.listdir``, which skips the per-entry objects of
    ``os.scandir``, and the layout's marks tell files from directories. A directory is
    entered only if it opens as one (never through a symbolic link). A file-named entry
    could still be a directory that is not ours: where the filesystem counts
    subdirectories in the link count (2 plus one per subdirectory: ext4, xfs, tmpfs, zfs)
    and every subdirectory was entered, the count proves there is none (unless a
    subdirectory appeared between the count and the listing, alongside a stranger's);
    otherwise (a subdirectory pruned, a stranger's, or btrfs, which reports 1) each
    file-named entry's type is read.
    """
    links = os.fstat(directory).st_nlink
    files, directories = _by_name(os.listdir(directory))
    entered = 0
    for name in directories:
        partial = _partial(key_so_far, name, is_file=False)
        if partial is None or not _may_hold(partial, prefix, after):
            continue
        child = _open_subdirectory(directory, name)
        if child is None:
            continue
        entered += 1
        try:
            _walk(child, partial, prefix, after, keys)
        finally:
            os.close(child)
    if files and entered != links - 2:
        files = _typed_files(directory)
    keys.extend(_file_keys(files, key_so_far, prefix, after))


def _discard(fd: int, temp: Path) -> None:
    """Close and remove a temporary file that will not become an object."""
    try:
        os.close(fd)
    finally:
        temp.unlink(missing_ok=True)


def _write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` to ``fd`` (``os.write`` may write less than asked)."""
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes:
    """The first ``size`` bytes of ``fd`` (fewer if it is shorter now), read straight into
    the returned ``bytes`` (one ``read`` up to 2 GiB: no second whole-file buffer), never
    more than ``size`` however much the file has grown since its ``fstat``."""
    first = os.read(fd, min(size, _READ_CHUNK))
    if len(first) == size or not first:
        return first
    chunks = [first]
    left = size - len(first)
    while left > 0:
        chunk = os.read(fd, min(left, _READ_CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def _read_in_chunks(fd: int, size: int, *, offset: int | None = None) -> bytes:
    """The first ``size`` bytes of ``fd`` from ``offset`` (else from where it stands),
    fewer if it is shorter, read in chunks of ``_READ_CHUNK_BYTES``, one worker-thread call
    each, straight into the ``bytes`` returned; never more than ``size`` however much the
    file has grown."""
    out = Filling(size)
    at = 0
    while at < size:
        with out.view[at : min(at + _READ_CHUNK_BYTES, size)] as target:
            if offset is None:
                count = await anyio.to_thread.run_sync(os.readv, fd, [target])
            else:
                count = await anyio.to_thread.run_sync(os.preadv, fd, [target], offset + at)
        if not count:
            break
        at += count
    return out.done(at)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    @property
    def directory(self) -> Path:
        return self._root

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        with self._boundary(f"put {key!r}"):
            if len(data) > _WRITE_CHUNK:
                return await self._put_in_chunks(key_path(key), data)
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
                return await _read_in_chunks(fd, size)
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
                return await _read_in_chunks(got, end - start, offset=start)
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

    def _open_temp(self) -> tuple[Path, int]:
        """A fresh file in ``tmp/`` (made again if a cleanup removed it), opened to write."""
        temp = self._tmp / uuid.uuid4().hex
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            return temp, os.open(temp, flags, 0o644)
        except FileNotFoundError:
            self._tmp.mkdir(parents=True, exist_ok=True)
            return temp, os.open(temp, flags, 0o644)

    def _finish_temp(self, fd: int) -> None:
        """Close a temporary file written in full, fsynced first if durable."""
        try:
            if self._durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_temp(self, data: bytes) -> Path:
        temp, fd = self._open_temp()
        try:
            try:
                _write_all(fd, memoryview(data))
            finally:
                self._finish_temp(fd)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return temp

    def _make_parents(self, target: Path) -> builtins.list[Path]:
        """Create ``target``'s missing parent directories, returning those it created."""
        missing: builtins.list[Path] = []
        parent = target.parent
        while not parent.is_dir():
            missing.append(parent)
            parent = parent.parent
        created: builtins.list[Path] = []
        for directory in reversed(missing):
            try:
                directory.mkdir()
            except FileExistsError:
                continue
            created.append(directory)
        return created

    def _put(self, names: tuple[str, ...], data: bytes) -> bool:
        target = self._objects.joinpath(*names)
        # Writing a large object only to lose the race is wasted work; for a small one the
        # extra stat would cost more than the write it might save. The link decides either way.
        if len(data) >= _RACE_CHECK_BYTES and target.exists():
            return False
        temp = self._write_temp(data)
        try:
            return self._link(temp, target)
        finally:
            temp.unlink(missing_ok=True)

    async def _put_in_chunks(self, names: tuple[str, ...], data: bytes) -> bool:
        """``_put`` for a large object: each chunk of ``_WRITE_CHUNK`` bytes written by a
        worker-thread call of its own (straight from ``data``, no copy), so that
        cancellation takes effect between chunks; the calls before and after the chunks do
        the rest, so that an object of N chunks costs N + 2 thread hops. Whatever ends it
        early removes the temporary file, shielded."""
        target = self._objects.joinpath(*names)
        opened = await anyio.to_thread.run_sync(self._open_temp_unless, target)
        if opened is None:
            return False
        temp, fd = opened
        done = False
        try:
            view = memoryview(data)
            for start in range(0, len(view), _WRITE_CHUNK):
                await anyio.to_thread.run_sync(_write_all, fd, view[start : start + _WRITE_CHUNK])
            done = True
            return await anyio.to_thread.run_sync(self._close_and_link, fd, temp, target)
        finally:
            if not done:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_discard, fd, temp)

    def _open_temp_unless(self, target: Path) -> tuple[Path, int] | None:
        """A fresh temporary file opened to write, or None when ``target`` exists already
        (writing a large object only to lose the race is wasted work)."""
        return None if target.exists() else self._open_temp()

    def _close_and_link(self, fd: int, temp: Path, target: Path) -> bool:
        """Finish the written ``temp`` and link it into place; the temporary file is gone
        afterwards whatever happens."""
        try:
            self._finish_temp(fd)
            return self._link(temp, target)
        finally:
            temp.unlink(missing_ok=True)

    def _link(self, temp: Path, target: Path) -> bool:
        """Link the written ``temp`` into place at ``target``; False if it exists."""
        created: builtins.list[Path] = []
        for _ in range(_PUT_ATTEMPTS):
            try:
                os.link(temp, target)
            except FileExistsError:
                return False
            except FileNotFoundError:
                # A directory of the key is missing: not made yet, or removed by a
                # concurrent delete that had just emptied it (which can also happen while
                # making them). Make them and link again.
                with contextlib.suppress(FileNotFoundError):
                    created += self._make_parents(target)
                continue
            if self._durable:
                for directory in {target.parent, *(path.parent for path in created)}:
                    _fsync_directory(directory)
            return True
        raise OSError(f"could not create the directories for {target}")

    def _open_object(self, names: tuple[str, ...]) -> int | None:
        """The object file at ``names`` opened for reading, None if there is none; each
        directory on the way is opened without following a symbolic link (a linked
        directory is not ours, and ``list`` does not enter it either)."""
        try:
            directory = os.open(self._objects, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        try:
            for name in names[:-1]:
                child = _open_subdirectory(directory, name)
                if child is None:
                    return None
                os.close(directory)
                directory = child
            return os.open(names[-1], _OBJECT, dir_fd=directory)
        except FileNotFoundError:
            return None
        finally:
            os.close(directory)

    def _get(
        self, key: str, names: tuple[str, ...], max_bytes: int | None
    ) -> bytes | tuple[int, int] | None:
        """The object's bytes, None when there is none, or, for one over
        ``_READ_CHUNK_BYTES``, its open file and size for the caller to read and close."""
        opened = self._open_regular(key, names)
        if opened is None:
            return None
        fd, size = opened
        try:
            if max_bytes is not None and size > max_bytes:
                raise ObjectTooLarge(key, size, max_bytes)
            if size > _READ_CHUNK_BYTES:
                kept, fd = fd, -1
                return kept, size
            return _read_exactly(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)

    def _get_range(self, key: str, names: tuple[str, ...]) -> int | None:
        """The object's open file for the caller to read a range of and close, or None when
        there is none."""
        opened = self._open_regular(key, names)
        return None if opened is None else opened[0]

    def _open_regular(self, key: str, names: tuple[str, ...]) -> tuple[int, int] | None:
        """The object's open file and its size, None when there is none. Raises
        ``NotARegularFile`` (the file closed) for a symbolic link or anything but a regular
        file."""
        try:
            fd = self._open_object(names)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.EMLINK):
                raise
            # O_NOFOLLOW met a symbolic link (Linux: ELOOP, some BSDs: EMLINK).
            raise NotARegularFile(f"{key!r} is a symbolic link; it was not followed") from None
        if fd is None:
            return None
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise NotARegularFile(
                    f"{key!r} is not a regular file (mode {stat.filemode(status.st_mode)}); "
                    "it was not read"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, status.st_size

    def _list(self, prefix: str, after: str) -> builtins.list[str]:
        # Every key that starts with the prefix's whole segments lies below their
        # directory: start there rather than reading each directory above it.
        parent, slash, _ = prefix.rpartition("/")
        key_so_far = parent + slash
        if not _may_hold(key_so_far, prefix, after):
            return []
        try:
            fd = os.open(self._objects, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return []
        for name in key_path(key_so_far + "k")[:-1]:
            try:
                child = _open_subdirectory(fd, name)
            finally:
                os.close(fd)
            if child is None:
                return []
            fd = child
        keys: builtins.list[str] = []
        try:
            _walk(fd, key_so_far, prefix, after, keys)
        finally:
            os.close(fd)
        if not "".join(keys).isascii():
            # A name that is not UTF-8 (decoded with surrogate escapes) is never ours.
            keys = [key for key in keys if _is_utf8(key)]
        # For strings without surrogates, code point order is UTF-8 byte order.
        keys.sort()
        return keys

    def _delete(self, paths: builtins.list[tuple[str, ...]]) -> None:
        parents: set[Path] = set()
        for names in paths:
            target = self._objects.joinpath(*names)
            try:
                target.unlink()
            except FileNotFoundError:
                continue
            parents.add(target.parent)
        emptied: set[Path] = set()
        # Deepest first, so that a directory is tried after the children it may have lost.
        for parent in sorted(parents, key=lambda path: len(path.parts), reverse=True):
            directory = parent
            while directory != self._objects:
                try:
                    directory.rmdir()
                except OSError:
                    break
                emptied.add(directory)
                directory = directory.parent
        if self._durable:
            survivors: set[Path] = set()
            for parent in parents:
                while parent in emptied:
                    parent = parent.parent
                survivors.add(parent)
            for directory in survivors:
                try:
                    _fsync_directory(directory)
                except FileNotFoundError:
                    continue
