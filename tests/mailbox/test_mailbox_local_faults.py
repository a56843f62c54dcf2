"""LocalMailbox's error boundary: transient filesystem errors are ``MailboxUnavailable``,
the operator's (full, read-only, denied) ``LocalAccessError`` naming what to do.

A full and a read-only filesystem are real: a 1 MiB tmpfs mounted for the test (skipped
where this process may not mount). EIO and a stale NFS handle cannot be produced on
demand, so the worker-thread half of an operation is replaced by one raising them."""

import errno
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from gradientmail.mailbox import LocalMailbox, MailboxUnavailable
from gradientmail.mailbox.local import LocalAccessError

pytestmark = pytest.mark.anyio


def _failing(code: int) -> object:
    def fail(*args: object) -> None:
        raise OSError(code, f"injected {errno.errorcode[code]}")

    return fail


OPERATIONS = {
    "_put": lambda box: box.put_if_absent("k", b"x"),
    "_get": lambda box: box.get("k"),
    "_list": lambda box: box.list(""),
    "_delete": lambda box: box.delete(["k"]),
}


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.ETIMEDOUT])
async def test_transient_filesystem_errors_are_unavailable(tmp_path: Path, code: int) -> None:
    async with LocalMailbox(tmp_path / "box") as box:
        for method, operation in OPERATIONS.items():
            setattr(box, method, _failing(code))
            with pytest.raises(MailboxUnavailable) as caught:
                await operation(box)
            assert isinstance(caught.value.__cause__, OSError)
            assert caught.value.__cause__.errno == code
            delattr(box, method)
        assert await box.put_if_absent("k", b"x")


async def test_a_denied_permission_names_the_directory_and_what_to_do(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path / "box") as box:
        box._get = _failing(errno.EACCES)  # type: ignore[method-assign]
        with pytest.raises(LocalAccessError) as caught:
            await box.get("k")
    error = caught.value
    assert error.errno == errno.EACCES
    assert isinstance(error, OSError)
    assert str(tmp_path / "box") in str(error)
    assert "give this user permission" in str(error)
    assert pickle.loads(pickle.dumps(error)).errno == errno.EACCES


async def test_other_filesystem_errors_propagate_unchanged(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path / "box") as box:
        box._list = _failing(errno.ENAMETOOLONG)  # type: ignore[method-assign]
        with pytest.raises(OSError, match="injected ENAMETOOLONG") as caught:
            await box.list("")
    assert type(caught.value) is OSError
    assert caught.value.errno == errno.ENAMETOOLONG


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted at a fresh directory, unmounted afterwards."""
    point = tmp_path / "mount"
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


async def test_a_full_disk_is_named_and_keeps_what_is_stored(small_filesystem: Path) -> None:
    async with LocalMailbox(small_filesystem / "box") as box:
        assert await box.put_if_absent("small", b"kept")
        with pytest.raises(LocalAccessError) as caught:
            await box.put_if_absent("large", b"x" * 2**21)
        assert caught.value.errno == errno.ENOSPC
        assert "free space" in str(caught.value)
        assert str(small_filesystem / "box") in str(caught.value)
        assert list(await box.list("")) == ["small"]
        assert await box.get("small") == b"kept"
        assert not list((small_filesystem / "box" / "tmp").iterdir())


async def test_a_read_only_filesystem_is_named_and_still_read(small_filesystem: Path) -> None:
    async with LocalMailbox(small_filesystem / "box") as box:
        assert await box.put_if_absent("k", b"kept")
        await anyio.run_process(["mount", "-o", "remount,ro", str(small_filesystem)])
        with pytest.raises(LocalAccessError) as caught:
            await box.put_if_absent("other", b"x")
        assert caught.value.errno == errno.EROFS
        assert "read-write" in str(caught.value)
        assert await box.get("k") == b"kept"
