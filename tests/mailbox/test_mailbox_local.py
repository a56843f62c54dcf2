"""LocalMailbox beyond the shared contract: real processes racing, the on-disk layout,
durability and the temporary area."""

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from _mailbox_memory import traced_get
from hypothesis import given, settings
from hypothesis import strategies as st

import gradientmail.mailbox._local_reads as local_reads
import gradientmail.mailbox._local_writes as local_writes
from gradientmail.mailbox import LocalMailbox, NotARegularFile, ObjectTooLarge, check_key
from gradientmail.mailbox.local import key_of, key_path

RACERS = 4
KEYS = 40

RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import anyio
    from gradientmail.mailbox import LocalMailbox

    directory, me, go, keys = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])

    async def main() -> None:
        async with LocalMailbox(directory) as mailbox:
            (go.parent / f"ready-{me}").touch()
            while not go.exists():
                await anyio.sleep(0.001)
            for index in range(keys):
                won = await mailbox.put_if_absent(f"race/{index}", me.encode() * 1000)
                print(index, int(won), flush=True)

    anyio.run(main, backend=sys.argv[5])
    """
)


def test_racing_processes_create_each_key_exactly_once(tmp_path: Path) -> None:
    """``RACERS`` processes, half of them on asyncio and half on trio, put the same keys at
    once: each key is created by exactly one of them, with its bytes."""
    directory = tmp_path / "mailbox"
    go = tmp_path / "go"
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    racers = [
        subprocess.Popen(
            [sys.executable, str(script), str(directory), f"p{rank}", str(go), str(KEYS), backend],
            stdout=subprocess.PIPE,
        )
        for rank, backend in zip(range(RACERS), ("asyncio", "trio") * RACERS, strict=False)
    ]
    try:
        # All of them wait on one signal once started, so that their puts overlap.
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < RACERS:
            assert time.monotonic() < deadline, "the racers did not start"
            assert all(racer.poll() is None for racer in racers), "a racer exited early"
            time.sleep(0.01)
        go.touch()
        outputs = {
            rank: racer.communicate(timeout=120)[0].decode() for rank, racer in enumerate(racers)
        }
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()
    assert all(racer.returncode == 0 for racer in racers)

    winners: dict[int, list[str]] = {index: [] for index in range(KEYS)}
    for rank, stdout in outputs.items():
        lines = stdout.split()
        assert len(lines) == 2 * KEYS
        for index, won in zip(lines[::2], lines[1::2], strict=True):
            if won == "1":
                winners[int(index)].append(f"p{rank}")
    anyio.run(_created_once, directory, winners)
    assert list((directory / "tmp").iterdir()) == []


async def _created_once(directory: Path, winners: dict[int, list[str]]) -> None:
    async with LocalMailbox(directory) as mailbox:
        for key_index, creators in winners.items():
            assert len(creators) == 1, f"key race/{key_index} created by {creators}"
            assert await mailbox.get(f"race/{key_index}") == creators[0].encode() * 1000
        assert len(await mailbox.list("race/")) == KEYS


keys = st.lists(
    st.text(
        alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="/\\\x00"),
        min_size=1,
        max_size=300,
    ).filter(lambda segment: segment not in (".", "..")),
    min_size=1,
    max_size=4,
).map("/".join)


@given(keys)
def test_the_layout_maps_every_key_to_a_path_and_back(key: str) -> None:
    if len(key.encode()) > 1024:
        return
    check_key(key)
    names = key_path(key)
    assert key_of(names) == key
    assert names[-1].endswith("%")
    assert all(not name.endswith("%") or name.endswith("%+") for name in names[:-1])
    assert all(len(name.encode()) <= 255 for name in names)


def test_the_layout_of_a_key_and_the_keys_below_it() -> None:
    assert key_path("a") == ("a%",)
    assert key_path("a/b") == ("a", "b%")
    assert key_path("100%/x") == ("100%25", "x%")
    long = "x" * 500
    assert key_path(long) == ("x" * 240 + "%+", "x" * 240 + "%+", "x" * 20 + "%")
    assert key_path("x" * 240) == ("x" * 240 + "%",)
    assert key_path("x" * 241) == ("x" * 240 + "%+", "x%")
    assert key_path("é" * 121) == ("é" * 120 + "%+", "é%")


@pytest.mark.anyio
async def test_objects_live_under_objects_and_temporaries_never_show(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path, durable=True) as mailbox:
        # Keys that look like the mailbox's own directories are ordinary keys.
        for key in ("tmp", "tmp/x", "objects", ".tmp", "a%", "a%+/b"):
            assert await mailbox.put_if_absent(key, key.encode())
        (tmp_path / "tmp" / "half-written").write_bytes(b"partial")
        assert await mailbox.list("") == [".tmp", "a%", "a%+/b", "objects", "tmp", "tmp/x"]
        for key in ("tmp", "tmp/x", "objects", ".tmp", "a%", "a%+/b"):
            assert await mailbox.get(key) == key.encode()
    assert sorted([path.name async for path in anyio.Path(tmp_path).iterdir()]) == [
        "objects",
        "tmp",
    ]


@pytest.mark.anyio
async def test_delete_removes_the_directories_it_empties(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path, durable=True) as mailbox:
        await mailbox.put_if_absent("rounds/1/snapshots/a", b"a")
        await mailbox.put_if_absent("rounds/1/snapshots/b", b"b")
        await mailbox.put_if_absent("rounds/2/claims/0", b"c")
        await mailbox.delete(["rounds/1/snapshots/a", "rounds/1/snapshots/b"])
        assert sorted(path.name for path in (tmp_path / "objects" / "rounds").iterdir()) == ["2"]
        await mailbox.delete(["rounds/2/claims/0"])
        assert list((tmp_path / "objects").iterdir()) == []
        assert await mailbox.put_if_absent("rounds/1/snapshots/a", b"again")


@pytest.mark.anyio
async def test_puts_and_deletes_racing_on_one_directory(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path) as mailbox:

        async def churn(worker: int) -> None:
            for index in range(100):
                key = f"shared/dir/{worker}-{index}"
                assert await mailbox.put_if_absent(key, b"x")
                assert await mailbox.get(key) == b"x"
                await mailbox.delete([key])

        async with anyio.create_task_group() as group:
            for worker in range(6):
                group.start_soon(churn, worker)
        assert await mailbox.list("") == []


@pytest.mark.anyio
async def test_stale_temporaries_are_removed_on_entry(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path):
        pass
    stale = tmp_path / "tmp" / "stale"
    fresh = tmp_path / "tmp" / "fresh"
    stale.write_bytes(b"left by a killed process")
    fresh.write_bytes(b"being written")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    async with LocalMailbox(tmp_path):
        pass
    assert not stale.exists()
    assert fresh.exists()


@pytest.mark.anyio
async def test_operations_work_without_entering(tmp_path: Path) -> None:
    mailbox = LocalMailbox(tmp_path / "never-entered")
    assert await mailbox.list("") == []
    assert await mailbox.get("k") is None
    assert await mailbox.put_if_absent("k", b"v")
    assert await mailbox.list("") == ["k"]
    assert "never-entered" in repr(mailbox)


@pytest.mark.anyio
async def test_ten_thousand_keys_list_from_a_marker(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path) as mailbox:
        objects = tmp_path / "objects" / "many"
        objects.mkdir(parents=True)
        # Written directly: this test is about listing, and the put path is tested above.
        for index in range(10_000):
            (objects / f"{index:05d}%").write_bytes(b"")
        listed = await mailbox.list("many/", after="many/00099")
    assert listed == [f"many/{index:05d}" for index in range(100, 10_000)]


tricky_segments = st.one_of(
    st.text(alphabet="ab%+!~ é\U0001f600", min_size=1, max_size=6),
    # Long enough to be cut into pieces, with escapes and wide characters at the cuts.
    st.text(alphabet="a%é\U0001f600", min_size=120, max_size=260),
).filter(lambda segment: segment not in (".", ".."))
tricky_keys = st.lists(tricky_segments, min_size=1, max_size=3).map("/".join)


def cuts(draw: st.DrawFn, keys: list[str]) -> str:
    """A prefix of one of ``keys`` (or of none), cut anywhere."""
    key = draw(st.sampled_from([*keys, ""]))
    return key[: draw(st.integers(0, len(key)))]


@st.composite
def listings(draw: st.DrawFn) -> tuple[list[str], str, str]:
    keys = draw(
        st.lists(tricky_keys, min_size=1, max_size=10, unique=True).map(
            lambda drawn: [key for key in drawn if len(key.encode()) <= 1024]
        )
    )
    prefix = cuts(draw, keys)
    if prefix.removesuffix("/").split("/")[-1] in (".", ".."):
        prefix = ""
    return keys, prefix, cuts(draw, keys) + draw(st.sampled_from(["", "%", "~", "a"]))


@pytest.mark.anyio
# Each example writes real files; the machine may be busy.
@settings(deadline=None)
@given(listings())
async def test_listing_matches_the_byte_ordered_filter_of_what_was_put(
    listing: tuple[list[str], str, str],
) -> None:
    keys, prefix, after = listing
    with tempfile.TemporaryDirectory() as directory:
        async with LocalMailbox(directory) as mailbox:
            for key in keys:
                assert await mailbox.put_if_absent(key, b"")
            expected = sorted(
                (key for key in keys if key.startswith(prefix) and key > after),
                key=lambda key: key.encode(),
            )
            assert await mailbox.list(prefix, after=after) == expected


@pytest.mark.anyio
async def test_entries_the_layout_never_makes_are_not_listed(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path) as mailbox:
        for key in ("d/a", "d/b/c", "d/e%/f"):
            assert await mailbox.put_if_absent(key, b"")
        here = tmp_path / "objects" / "d"
        # A directory named like an object, with an object-named file inside.
        (here / "stray%").mkdir()
        (here / "stray%" / "inner%").write_bytes(b"")
        # A file named like a directory, and a symbolic link to one of ours.
        (here / "plain").write_bytes(b"")
        (here / "link").symlink_to(here / "b")
        # A name that is not UTF-8.
        os.close(os.open(os.fsencode(here) + b"/\xff%", os.O_CREAT | os.O_WRONLY))
        assert await mailbox.list("") == ["d/a", "d/b/c", "d/e%/f"]
        assert await mailbox.list("d/", after="d/a") == ["d/b/c", "d/e%/f"]
        assert await mailbox.list("d/s") == []
        assert await mailbox.list("d/l") == []
        assert await mailbox.list("d/b/") == ["d/b/c"]
        assert await mailbox.list("d/link/") == []
        assert await mailbox.list("d/plain/") == []


@pytest.mark.anyio
async def test_links_and_special_files_at_a_key_are_never_followed_or_read(
    tmp_path: Path,
) -> None:
    async with LocalMailbox(tmp_path / "box") as mailbox:
        assert await mailbox.put_if_absent("records/0", b"ours")
        assert await mailbox.put_if_absent("elsewhere/secret", b"not through a link")
        here = tmp_path / "box" / "objects"
        # Read whole, /dev/zero would fill the memory; a FIFO would block the reader.
        (here / "records" / "1%").symlink_to("/dev/zero")
        (here / "records" / "2%").symlink_to(here / "records" / "0%")
        os.mkfifo(here / "records" / "3%")
        (here / "linked").symlink_to(here / "elsewhere")
        with anyio.fail_after(10):
            for key in ("records/1", "records/2"):
                with pytest.raises(NotARegularFile, match="symbolic link; it was not followed"):
                    await mailbox.get(key, max_bytes=2**20)
                with pytest.raises(NotARegularFile):
                    await mailbox.get(key)
            with pytest.raises(NotARegularFile, match=r"not a regular file \(mode p"):
                await mailbox.get("records/3")
            # A linked directory is not entered, as ``list`` does not enter it.
            assert await mailbox.get("linked/secret") is None
        assert await mailbox.get("records/0") == b"ours"


@pytest.mark.anyio
async def test_an_oversized_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    async with LocalMailbox(tmp_path / "box") as mailbox:
        assert await mailbox.put_if_absent("records/0", b"")
        # Sparse: 256 MiB by its size, no memory or disk behind it.
        os.truncate(tmp_path / "box" / "objects" / "records" / "0%", 256 * 2**20)
        with pytest.raises(ObjectTooLarge) as caught:
            await mailbox.get("records/0", max_bytes=2**20)
        assert caught.value.size == 256 * 2**20


# Segments whose pieces (cut every 240 bytes) end at or around dots, escapes and wide
# characters: where ``..`` once became a directory name of its own.
cut_segments = st.one_of(
    st.builds(
        lambda width, tail: "a" * width + tail,
        st.integers(230, 250),
        st.text(alphabet=".%+a", min_size=1, max_size=4),
    ),
    st.text(alphabet=".%+é", min_size=1, max_size=300),
).filter(lambda segment: segment not in (".", ".."))
cut_keys = st.lists(cut_segments, min_size=1, max_size=3).map("/".join)


@given(st.lists(cut_keys, min_size=2, max_size=6, unique=True))
def test_distinct_keys_map_to_distinct_paths_inside_objects(drawn: list[str]) -> None:
    keys = [key for key in drawn if len(key.encode()) <= 1024]
    paths = {key: key_path(key) for key in keys}
    assert len(set(paths.values())) == len(keys)
    for key, names in paths.items():
        assert all(name not in ("", ".", "..") and "/" not in name for name in names)
        assert key_of(names) == key


def test_a_long_segment_ending_in_dots_stays_in_its_directory() -> None:
    key = "A" * 240 + "../manifest"
    assert key_path(key) == ("A" * 240 + "%+", "%..", "manifest%")
    assert key_path("A" * 240 + "./x") == ("A" * 240 + "%+", "%.", "x%")
    assert key_path("A" * 240 + "%../x")[1] == "%25.."


@pytest.mark.anyio
@settings(deadline=None, max_examples=40)
@given(st.lists(cut_keys, min_size=1, max_size=6, unique=True))
async def test_every_key_put_is_stored_inside_the_root_and_listed_exactly(
    drawn: list[str],
) -> None:
    keys = [key for key in drawn if len(key.encode()) <= 1024]
    with tempfile.TemporaryDirectory() as directory:
        async with LocalMailbox(directory) as mailbox:
            for key in keys:
                assert await mailbox.put_if_absent(key, key.encode())
            assert await mailbox.list("") == sorted(keys, key=lambda key: key.encode())
            for key in keys:
                assert await mailbox.get(key) == key.encode()
        stored, outside = _object_files(Path(directory))
        assert stored == len(keys)
        assert outside == []


def _object_files(directory: Path) -> tuple[int, list[Path]]:
    """How many files under ``directory`` are named like an object, and those of them whose
    resolved path is not below ``directory/objects``."""
    objects = (directory / "objects").resolve()
    paths = [
        Path(root, name).resolve()
        for root, _, names in os.walk(directory)
        for name in names
        if name.endswith("%")
    ]
    return len(paths), [path for path in paths if not path.is_relative_to(objects)]


@pytest.mark.anyio
async def test_large_objects_are_written_in_chunks_and_a_cancelled_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_writes, "WRITE_CHUNK", 2**20)
    data = os.urandom(5 * 2**20 + 3)
    temporaries = tmp_path / "box" / "tmp"
    async with LocalMailbox(tmp_path / "box") as mailbox:
        assert await mailbox.put_if_absent("whole", data)
        assert await mailbox.get("whole") == data
        assert await mailbox.put_if_absent("whole", data) is False

        def written() -> int:
            return sum(entry.stat().st_size for entry in os.scandir(temporaries))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(mailbox.put_if_absent, "cancelled", os.urandom(64 * 2**20))
                # Cancelled once part of it, and not all, is in the temporary file.
                while not 0 < await anyio.to_thread.run_sync(written) < 64 * 2**20:
                    await anyio.lowlevel.checkpoint()
                group.cancel_scope.cancel()
        assert await mailbox.get("cancelled") is None
        assert list(temporaries.iterdir()) == []


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.anyio
@pytest.mark.parametrize("size", [2**20 - 1, 2**20, 2**20 + 1, 5 * 2**20 + 3])
async def test_large_objects_are_read_in_chunks_into_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setattr(local_reads, "READ_CHUNK_BYTES", 2**20)
    data = os.urandom(size)
    async with LocalMailbox(tmp_path / "box") as mailbox:
        assert await mailbox.put_if_absent("blob", data)
        with pytest.raises(ObjectTooLarge):
            await mailbox.get("blob", max_bytes=size - 1)
        got, peak = await traced_get(mailbox, "blob", size)
    assert got == data
    assert type(got) is bytes
    # The object once, and no second whole-object buffer (a bytearray turned into bytes,
    # or chunks joined, would peak at twice its size).
    assert peak < size + 2**19


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
@pytest.mark.anyio
async def test_a_cancelled_chunked_read_closes_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_reads, "READ_CHUNK_BYTES", 2**16)
    async with LocalMailbox(tmp_path / "box") as mailbox:
        assert await mailbox.put_if_absent("blob", os.urandom(16 * 2**20))
        before = await anyio.to_thread.run_sync(_open_descriptors)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(mailbox.get, "blob")
                # Cancelled while the object's file is open, between two of its 256 chunks.
                while await anyio.to_thread.run_sync(_open_descriptors) == before:
                    await anyio.lowlevel.checkpoint()
                group.cancel_scope.cancel()
        assert await anyio.to_thread.run_sync(_open_descriptors) == before
