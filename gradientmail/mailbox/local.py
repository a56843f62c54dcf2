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
pieces, each but the last a directory whose name ends in ``%+``. Keys are thereby any valid
key (``check_key``) and decode back exactly; ``key_path`` and ``key_of`` are that mapping.

Guarantees
----------
``put_if_absent`` writes the bytes to a fresh file in ``tmp/`` and hard-links it into
place with ``os.link``, which fails with ``EEXIST`` when the object already exists: creation
is atomic across threads and processes (the loser gets False) and a reader never sees a
partial object. ``list`` reads directory entries only (never a file), prunes subtrees that
cannot match the prefix or lie wholly at or before ``after``, and returns keys in UTF-8 byte
order. ``delete`` unlinks and then removes the directories it emptied; a concurrent
``put_if_absent`` whose directory vanished under it recreates it and tries again.

With ``durable=True`` the object's bytes, its directory entry and every directory created
for it are fsynced before ``put_if_absent`` returns (and directory entries after
``delete``), so a created object survives a power loss; without it, a crash of the machine
(not of the process) may lose recent objects.

Every operation runs in one worker thread (``anyio.to_thread.run_sync``), never on the event
loop. Cancellation waits for that thread to finish its operation, so a cancelled
``put_if_absent`` has either created its object or not, and the caller reads it back.

The filesystem must support hard links and be case-sensitive (``__aenter__`` checks the
latter): Linux ext4, xfs, btrfs, zfs and NFSv3+ qualify; macOS's default case-insensitive
APFS does not. Temporary files left behind by a killed process are removed by the next
``__aenter__`` once they are an hour old. Filesystem errors other than a missing object
(permissions, a full disk) propagate as ``OSError``.
"""

import builtins
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio.to_thread

from gradientmail.mailbox._base import check_key, check_prefix

__all__ = ["LocalMailbox", "key_of", "key_path"]

_OBJECTS = "objects"
_TMP = "tmp"
_PIECE_BYTES = 240
_FILE_MARK = "%"
_MORE_MARK = "%+"
_STALE_TEMP_SECONDS = 3600.0
# A put whose parent directory is removed by a concurrent delete retries; this bounds a
# pathological livelock, not any expected case.
_PUT_ATTEMPTS = 100


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


def key_path(key: str) -> tuple[str, ...]:
    """The names, relative to ``objects/``, of the file that holds ``key`` (already checked)."""
    names: list[str] = []
    segments = key.split("/")
    for index, segment in enumerate(segments):
        pieces = _pieces(segment)
        names.extend(piece + _MORE_MARK for piece in pieces[:-1])
        last = index == len(segments) - 1
        names.append(pieces[-1] + _FILE_MARK if last else pieces[-1])
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
        return await anyio.to_thread.run_sync(self._put, key_path(key), data)

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        return await anyio.to_thread.run_sync(self._get, key_path(key))

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        return await anyio.to_thread.run_sync(self._list, prefix, after)

    async def delete(self, keys: Iterable[str]) -> None:
        paths = [key_path(check_key(key)) for key in keys]
        if paths:
            await anyio.to_thread.run_sync(self._delete, paths)

    async def __aenter__(self) -> Self:
        await anyio.to_thread.run_sync(self._prepare)
        return self

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

    def _write_temp(self, data: bytes) -> Path:
        temp = self._tmp / uuid.uuid4().hex
        try:
            handle = open(temp, "xb")  # noqa: SIM115 (closed below, after an optional fsync)
        except FileNotFoundError:
            self._tmp.mkdir(parents=True, exist_ok=True)
            handle = open(temp, "xb")  # noqa: SIM115
        try:
            with handle:
                handle.write(data)
                if self._durable:
                    handle.flush()
                    os.fsync(handle.fileno())
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
        # Writing a large object only to lose the race is wasted work; the link decides.
        if target.exists():
            return False
        temp = self._write_temp(data)
        try:
            for _ in range(_PUT_ATTEMPTS):
                try:
                    created = self._make_parents(target)
                    os.link(temp, target)
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    # A concurrent delete removed a directory it had just emptied.
                    continue
                if self._durable:
                    for directory in {target.parent, *(path.parent for path in created)}:
                        _fsync_directory(directory)
                return True
            raise OSError(f"could not create the directories for {target}")
        finally:
            temp.unlink(missing_ok=True)

    def _get(self, names: tuple[str, ...]) -> bytes | None:
        try:
            with open(self._objects.joinpath(*names), "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def _list(self, prefix: str, after: str) -> builtins.list[str]:
        keys = list(self._walk(self._objects, "", prefix, after))
        keys.sort(key=lambda key: key.encode("utf-8"))
        return keys

    def _walk(
        self, directory: Path | str, key_so_far: str, prefix: str, after: str
    ) -> Iterator[str]:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            partial = _partial(key_so_far, entry.name, is_file=not is_dir)
            if partial is None:
                continue
            if is_dir:
                if _may_hold(partial, prefix, after):
                    yield from self._walk(entry.path, partial, prefix, after)
            elif partial.startswith(prefix) and partial > after:
                yield partial

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
