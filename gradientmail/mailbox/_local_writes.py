"""``LocalMailbox``'s writes: an object created atomically (its bytes in a fresh file in
``tmp/``, hard-linked into place, which fails when the object exists), and objects deleted
with the directories they emptied; with ``durable``, every file and directory entry
fsynced first.

The methods but ``Writer.put_in_chunks`` block: they run in a worker thread.
"""

import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

__all__ = ["WRITE_CHUNK", "Writer"]

# A put whose parent directory is removed by a concurrent delete retries; this bounds a
# pathological livelock, not any expected case.
_PUT_ATTEMPTS = 100
_RACE_CHECK_BYTES = 1 << 16
WRITE_CHUNK = 16 << 20
"""Objects larger than this are written in chunks this size, one worker-thread call each."""


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


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_parents(target: Path) -> list[Path]:
    """Create ``target``'s missing parent directories, returning those it created."""
    missing: list[Path] = []
    parent = target.parent
    while not parent.is_dir():
        missing.append(parent)
        parent = parent.parent
    created: list[Path] = []
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        created.append(directory)
    return created


@dataclass(frozen=True)
class Writer:
    """Creates and deletes the object files below ``objects``, through temporary files in
    ``tmp``; fsyncs what it wrote when ``durable``. Safe across threads and processes."""

    objects: Path
    tmp: Path
    durable: bool

    def put(self, names: tuple[str, ...], data: bytes) -> bool:
        """Create the object at ``names`` holding ``data``; False if it exists."""
        target = self.objects.joinpath(*names)
        # Writing a large object only to lose the race is wasted work; for a small one the
        # extra stat would cost more than the write it might save. The link decides either way.
        if len(data) >= _RACE_CHECK_BYTES and target.exists():
            return False
        temp = self._write_temp(data)
        try:
            return self._link(temp, target)
        finally:
            temp.unlink(missing_ok=True)

    async def put_in_chunks(self, names: tuple[str, ...], data: bytes) -> bool:
        """``put`` for a large object: each chunk of ``WRITE_CHUNK`` bytes written by a
        worker-thread call of its own (straight from ``data``, no copy), so that
        cancellation takes effect between chunks; the calls before and after the chunks do
        the rest, so that an object of N chunks costs N + 2 thread hops. Whatever ends it
        early removes the temporary file, shielded."""
        target = self.objects.joinpath(*names)
        opened = await anyio.to_thread.run_sync(self._open_temp_unless, target)
        if opened is None:
            return False
        temp, fd = opened
        done = False
        try:
            view = memoryview(data)
            for start in range(0, len(view), WRITE_CHUNK):
                await anyio.to_thread.run_sync(_write_all, fd, view[start : start + WRITE_CHUNK])
            done = True
            return await anyio.to_thread.run_sync(self._close_and_link, fd, temp, target)
        finally:
            if not done:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_discard, fd, temp)

    def delete(self, paths: list[tuple[str, ...]]) -> None:
        """Unlink the objects at ``paths`` (those missing skipped), then remove the
        directories that emptied, deepest first."""
        parents: set[Path] = set()
        for names in paths:
            target = self.objects.joinpath(*names)
            try:
                target.unlink()
            except FileNotFoundError:
                continue
            parents.add(target.parent)
        emptied: set[Path] = set()
        # Deepest first, so that a directory is tried after the children it may have lost.
        for parent in sorted(parents, key=lambda path: len(path.parts), reverse=True):
            directory = parent
            while directory != self.objects:
                try:
                    directory.rmdir()
                except OSError:
                    break
                emptied.add(directory)
                directory = directory.parent
        if self.durable:
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

    def _open_temp(self) -> tuple[Path, int]:
        """A fresh file in ``tmp/`` (made again if a cleanup removed it), opened to write."""
        temp = self.tmp / uuid.uuid4().hex
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            return temp, os.open(temp, flags, 0o644)
        except FileNotFoundError:
            self.tmp.mkdir(parents=True, exist_ok=True)
            return temp, os.open(temp, flags, 0o644)

    def _finish_temp(self, fd: int) -> None:
        """Close a temporary file written in full, fsynced first if durable."""
        try:
            if self.durable:
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
        created: list[Path] = []
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
                    created += _make_parents(target)
                continue
            if self.durable:
                for directory in {target.parent, *(path.parent for path in created)}:
                    _fsync_directory(directory)
            return True
        raise OSError(f"could not create the directories for {target}")
