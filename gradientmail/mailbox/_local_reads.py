"""``LocalMailbox``'s reads: an object's file opened without following a symbolic link and
checked to be a regular file, then read whole in one worker-thread call, or in chunks of
``READ_CHUNK_BYTES``, one worker-thread call each, straight into the ``bytes`` returned.

The functions but ``read_in_chunks`` block: they run in a worker thread.
"""

import errno
import os
import stat
from pathlib import Path

import anyio.to_thread

from gradientmail._bytes import Filling
from gradientmail.mailbox._base import NotARegularFile, ObjectTooLarge

__all__ = [
    "READ_CHUNK_BYTES",
    "open_for_range",
    "open_subdirectory",
    "read_in_chunks",
    "read_object",
]

_SUBDIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# Never through a symbolic link; never waiting for a FIFO's writer (non-blocking changes
# nothing for a regular file).
_OBJECT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
# The most one read(2) returns on Linux.
_READ_CHUNK = 0x7FFFF000
READ_CHUNK_BYTES = 16 << 20
"""Objects larger than this are read in chunks this size, one worker-thread call each."""


def open_subdirectory(directory: int, name: str) -> int | None:
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


def _open_object(objects: Path, names: tuple[str, ...]) -> int | None:
    """The object file at ``names`` below ``objects`` opened for reading, None if there is
    none; each directory on the way is opened without following a symbolic link (a linked
    directory is not ours, and ``list`` does not enter it either)."""
    try:
        directory = os.open(objects, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        for name in names[:-1]:
            child = open_subdirectory(directory, name)
            if child is None:
                return None
            os.close(directory)
            directory = child
        return os.open(names[-1], _OBJECT, dir_fd=directory)
    except FileNotFoundError:
        return None
    finally:
        os.close(directory)


def read_object(
    objects: Path, key: str, names: tuple[str, ...], max_bytes: int | None
) -> bytes | tuple[int, int] | None:
    """The object's bytes, None when there is none, or, for one over
    ``READ_CHUNK_BYTES``, its open file and size for the caller to read and close."""
    opened = _open_regular(objects, key, names)
    if opened is None:
        return None
    fd, size = opened
    try:
        if max_bytes is not None and size > max_bytes:
            raise ObjectTooLarge(key, size, max_bytes)
        if size > READ_CHUNK_BYTES:
            kept, fd = fd, -1
            return kept, size
        return _read_exactly(fd, size)
    finally:
        if fd >= 0:
            os.close(fd)


def open_for_range(objects: Path, key: str, names: tuple[str, ...]) -> int | None:
    """The object's open file for the caller to read a range of and close, or None when
    there is none."""
    opened = _open_regular(objects, key, names)
    return None if opened is None else opened[0]


def _open_regular(objects: Path, key: str, names: tuple[str, ...]) -> tuple[int, int] | None:
    """The object's open file and its size, None when there is none. Raises
    ``NotARegularFile`` (the file closed) for a symbolic link or anything but a regular
    file."""
    try:
        fd = _open_object(objects, names)
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


async def read_in_chunks(fd: int, size: int, *, offset: int | None = None) -> bytes:
    """The first ``size`` bytes of ``fd`` from ``offset`` (else from where it stands),
    fewer if it is shorter, read in chunks of ``READ_CHUNK_BYTES``, one worker-thread call
    each, straight into the ``bytes`` returned; never more than ``size`` however much the
    file has grown."""
    out = Filling(size)
    at = 0
    while at < size:
        with out.view[at : min(at + READ_CHUNK_BYTES, size)] as target:
            if offset is None:
                count = await anyio.to_thread.run_sync(os.readv, fd, [target])
            else:
                count = await anyio.to_thread.run_sync(os.preadv, fd, [target], offset + at)
        if not count:
            break
        at += count
    return out.done(at)
