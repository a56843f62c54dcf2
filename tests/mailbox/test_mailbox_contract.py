"""The mailbox contract, one suite for every backend (memory, local, s3 on moto, and ceph:
S3 on Ceph's RADOS Gateway, in ``nox -s ceph``) on asyncio and trio."""

import os
import pickle
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import anyio
import pytest

from gradientmail.errors import RecordError
from gradientmail.mailbox import Mailbox, ObjectTooLarge, RangedMailbox, S3Mailbox

pytestmark = pytest.mark.anyio

LARGE = 64 * 2**20


def byte_order(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda key: key.encode("utf-8"))


async def put_all(mailbox: Mailbox, keys: list[str], *, limit: int = 32) -> None:
    """Create ``keys`` concurrently, each holding its own name."""
    limiter = anyio.CapacityLimiter(limit)

    async def put(key: str) -> None:
        async with limiter:
            assert await mailbox.put_if_absent(key, key.encode())

    async with anyio.create_task_group() as group:
        for key in keys:
            group.start_soon(put, key)


MANY_KEYS = tuple(f"many/{index:05d}" for index in range(1010))
S3_PREFIX = "run/"


def _seeded_many(admin: Any) -> str:
    # A thousand PUTs take seconds: seeded once per server, shared by both event loops,
    # and only ever read.
    name = "many-keys-read-only"
    admin.create_bucket(Bucket=name)

    def put(key: str) -> None:
        admin.put_object(Bucket=name, Key=S3_PREFIX + key, Body=key.encode())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, MANY_KEYS))
    return name


@pytest.fixture(scope="session")
def _many_s3_bucket(_moto_admin: Any) -> str:
    return _seeded_many(_moto_admin)


@pytest.fixture(scope="session")
def _many_ceph_bucket(_ceph_admin: Any) -> str:
    return _seeded_many(_ceph_admin)


@pytest.fixture
async def many(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Mailbox]:
    """A mailbox holding exactly ``MANY_KEYS`` (each holding its name): do not modify it."""
    if backend in ("s3", "ceph"):
        endpoint: str = request.getfixturevalue("s3_endpoint")
        bucket: str = request.getfixturevalue(f"_many_{backend}_bucket")
        async with S3Mailbox(bucket, S3_PREFIX, endpoint_url=endpoint) as opened:
            yield opened
        return
    make_mailbox: Callable[[], Mailbox] = request.getfixturevalue("make_mailbox")
    async with make_mailbox() as mailbox:
        await put_all(mailbox, list(MANY_KEYS))
        yield mailbox


async def test_put_get_and_create_once(mailbox: Mailbox) -> None:
    assert await mailbox.get("k") is None
    assert await mailbox.put_if_absent("k", b"first") is True
    assert await mailbox.put_if_absent("k", b"second") is False
    assert await mailbox.get("k") == b"first"
    assert await mailbox.put_if_absent("empty", b"") is True
    assert await mailbox.get("empty") == b""


async def test_get_of_a_missing_key_is_none(mailbox: Mailbox) -> None:
    assert await mailbox.get("never/written") is None
    await mailbox.put_if_absent("never/written/below", b"x")
    assert await mailbox.get("never/written") is None


async def test_a_key_and_keys_below_it_coexist(mailbox: Mailbox) -> None:
    assert await mailbox.put_if_absent("a", b"1")
    assert await mailbox.put_if_absent("a/b", b"2")
    assert await mailbox.put_if_absent("a/b/c", b"3")
    assert [await mailbox.get(key) for key in ("a", "a/b", "a/b/c")] == [b"1", b"2", b"3"]
    assert await mailbox.list("") == ["a", "a/b", "a/b/c"]
    await mailbox.delete(["a/b"])
    assert await mailbox.list("") == ["a", "a/b/c"]


async def test_fifty_racing_puts_create_exactly_once(mailbox: Mailbox) -> None:
    results: dict[int, bool] = {}
    start = anyio.Event()

    async def contend(index: int) -> None:
        await start.wait()
        results[index] = await mailbox.put_if_absent("race", f"writer {index}".encode() * 100)

    async with anyio.create_task_group() as group:
        for index in range(50):
            group.start_soon(contend, index)
        start.set()

    winners = [index for index, created in results.items() if created]
    assert len(results) == 50
    assert len(winners) == 1
    assert await mailbox.get("race") == f"writer {winners[0]}".encode() * 100


async def test_no_torn_reads_while_a_large_object_is_written(mailbox: Mailbox) -> None:
    data = os.urandom(LARGE)
    seen: list[int | None] = []
    reading = anyio.Event()
    written = anyio.Event()

    async def read() -> None:
        reading.set()
        while True:
            value = await mailbox.get("big")
            # Compare here and keep only the verdict: holding many 64 MiB copies is wasteful.
            seen.append(None if value is None else int(value == data))
            if value is not None and written.is_set():
                return
            await anyio.sleep(0.002)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            group.start_soon(read)
            await reading.wait()
            assert await mailbox.put_if_absent("big", data)
            written.set()

    assert seen[-1] == 1
    assert set(seen) <= {None, 1}, "a reader saw a partial or wrong object"


async def test_listing_is_in_utf8_byte_order(mailbox: Mailbox) -> None:
    # U+FFFD sorts before U+1F600 in UTF-8 (and code points) but after it in UTF-16.
    names = ["z", "Z", "é", "日本", "\ufffd", "\U0001f600", "a b", "~", "0", "e\u0301", "ß"]
    keys = [f"dir/{name}" for name in names]
    await put_all(mailbox, keys)
    assert list(await mailbox.list("dir/")) == byte_order(keys)
    assert list(await mailbox.list("dir/", after="dir/\ufffd")) == ["dir/\U0001f600"]
    assert list(await mailbox.list("dir/", after="dir/é")) == byte_order(
        [key for key in keys if key.encode() > "dir/é".encode()]
    )


async def test_listing_by_prefix_and_after(mailbox: Mailbox) -> None:
    keys = ["a/1", "a/10", "a/1/x", "a/2", "ab", "b/1", "a/1x/y"]
    await put_all(mailbox, keys)
    assert list(await mailbox.list("")) == byte_order(keys)
    assert list(await mailbox.list("a/1")) == ["a/1", "a/1/x", "a/10", "a/1x/y"]
    assert list(await mailbox.list("a/1/")) == ["a/1/x"]
    assert list(await mailbox.list("a")) == ["a/1", "a/1/x", "a/10", "a/1x/y", "a/2", "ab"]
    assert list(await mailbox.list("a/")) == ["a/1", "a/1/x", "a/10", "a/1x/y", "a/2"]
    assert list(await mailbox.list("a/", after="a/1/x")) == ["a/10", "a/1x/y", "a/2"]
    assert list(await mailbox.list("a/", after="a/15")) == ["a/1x/y", "a/2"]
    assert list(await mailbox.list("a/", after="a/2")) == []
    assert list(await mailbox.list("", after="a/3")) == ["ab", "b/1"]
    # ``after`` before the prefix cuts nothing.
    assert list(await mailbox.list("b/", after="a")) == ["b/1"]
    assert list(await mailbox.list("c")) == []


async def test_more_than_a_page_is_listed(many: Mailbox) -> None:
    keys = list(MANY_KEYS)
    assert list(await many.list("many/")) == keys
    assert list(await many.list("many/", after="many/00499")) == keys[500:]
    assert list(await many.list("many/", after="many/00999x")) == keys[1000:]
    assert list(await many.list("many/", after=keys[-1])) == []
    assert await many.get(keys[1005]) == keys[1005].encode()


async def test_more_than_a_thousand_keys_are_deleted_at_once(mailbox: Mailbox) -> None:
    keys = [f"gone/{index:05d}" for index in range(1010)]
    # Some in the first thousand and some after: both of S3's delete chunks must land.
    existing = keys[:5] + keys[995:1005] + keys[-5:]
    await put_all(mailbox, [*existing, "kept"])
    with anyio.fail_after(60):
        await mailbox.delete(iter(keys))
    assert list(await mailbox.list("")) == ["kept"]
    assert [await mailbox.get(key) for key in existing] == [None] * len(existing)


async def test_delete_is_idempotent(mailbox: Mailbox) -> None:
    await put_all(mailbox, ["d/1", "d/2", "d/3"])
    await mailbox.delete([])
    await mailbox.delete(["d/1", "d/1", "missing", "d/missing/deeper"])
    assert list(await mailbox.list("d/")) == ["d/2", "d/3"]
    assert await mailbox.get("d/1") is None
    await mailbox.delete(["d/1", "d/2", "d/3"])
    await mailbox.delete(["d/1", "d/2", "d/3"])
    assert list(await mailbox.list("")) == []
    # A deleted key can be created again.
    assert await mailbox.put_if_absent("d/1", b"again")
    assert await mailbox.get("d/1") == b"again"


BAD_KEYS = [
    ("", "empty"),
    ("/leading", "start with '/'"),
    ("trailing/", "segments must not be empty"),
    ("double//slash", "segments must not be empty"),
    ("a/./b", "'.' or '..'"),
    ("..", "'.' or '..'"),
    ("a/..", "'.' or '..'"),
    ("nul\x00byte", "NUL"),
    ("back\\slash", "backslash"),
    ("x" * 1025, "1024"),
    ("é" * 513, "1024"),
    ("lone\ud800surrogate", "UTF-8"),
]


@pytest.mark.parametrize(("key", "rule"), BAD_KEYS, ids=[rule for _, rule in BAD_KEYS])
async def test_bad_keys_are_rejected_alike(mailbox: Mailbox, key: str, rule: str) -> None:
    operations: list[Callable[[], object]] = [
        partial(mailbox.put_if_absent, key, b"x"),
        partial(mailbox.get, key),
        partial(mailbox.delete, ["fine", key]),
    ]
    for operation in operations:
        with pytest.raises(ValueError, match="invalid mailbox key") as caught:
            await operation()  # type: ignore[misc]
        assert rule in str(caught.value)
    assert list(await mailbox.list("")) == []


@pytest.mark.parametrize("prefix", ["/a", "a//", "a/../b", "x\\y", "a/./"])
async def test_bad_prefixes_are_rejected_alike(mailbox: Mailbox, prefix: str) -> None:
    with pytest.raises(ValueError, match="invalid mailbox prefix"):
        await mailbox.list(prefix)


async def test_the_longest_valid_key_works(mailbox: Mailbox) -> None:
    # S3Mailbox in this suite has the 4-byte prefix "run/".
    key = "k/" + "é" * 509
    assert len(key.encode()) == 1020
    assert await mailbox.put_if_absent(key, b"long")
    assert await mailbox.get(key) == b"long"
    assert list(await mailbox.list("k/")) == [key]


async def test_a_size_cap_refuses_larger_objects_alike(mailbox: Mailbox) -> None:
    assert await mailbox.put_if_absent("capped", b"x" * 1000)
    assert await mailbox.put_if_absent("empty", b"")
    assert await mailbox.get("capped", max_bytes=1000) == b"x" * 1000
    assert await mailbox.get("empty", max_bytes=0) == b""
    assert await mailbox.get("missing", max_bytes=0) is None
    with pytest.raises(ObjectTooLarge) as caught:
        await mailbox.get("capped", max_bytes=999)
    assert (caught.value.key, caught.value.size, caught.value.max_bytes) == ("capped", 1000, 999)
    assert isinstance(caught.value, RecordError)
    assert "'capped' holds 1000 bytes, more than the 999 allowed" in str(caught.value)
    assert pickle.loads(pickle.dumps(caught.value)).args == caught.value.args
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="max_bytes must be None or a number of bytes"):
            await mailbox.get("capped", max_bytes=bad)  # type: ignore[arg-type]


async def test_a_ranged_read_answers_the_bytes_of_the_range_alike(mailbox: Mailbox) -> None:
    assert isinstance(mailbox, RangedMailbox)
    data = bytes(range(256)) * 4
    assert await mailbox.put_if_absent("ranged", data)
    assert await mailbox.get_range("ranged", 0, 1) == data[:1]
    assert await mailbox.get_range("ranged", 100, 612) == data[100:612]
    assert await mailbox.get_range("ranged", 1000, 2000) == data[1000:]
    assert await mailbox.get_range("ranged", 1024, 1025) == b""
    assert await mailbox.get_range("ranged", 5000, 5001) == b""
    assert await mailbox.get_range("missing", 0, 10) is None
    for start, end in ((-1, 3), (3, 3), (4, 3), (0, 1.5)):
        with pytest.raises(ValueError, match="a byte range needs 0 <= start < end"):
            await mailbox.get_range("ranged", start, end)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid mailbox key"):
        await mailbox.get_range("/bad", 0, 1)


async def test_a_ranged_read_of_a_large_object_reads_only_its_range(mailbox: Mailbox) -> None:
    data = os.urandom(LARGE // 4)
    assert await mailbox.put_if_absent("large", data)
    middle = len(data) // 2
    assert (
        await mailbox.get_range("large", middle - 3, middle + 5 * 2**20)
        == (data[middle - 3 : middle + 5 * 2**20])
    )
    assert await mailbox.get_range("large", len(data) - 10, len(data) + 10) == data[-10:]
