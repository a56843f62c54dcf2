"""Large objects on S3: multipart uploads with parallel parts and parallel ranged GETs, on a
real moto server (behind a relay on 127.0.0.1 that logs, holds or fails requests)."""

import os
from typing import Any

import anyio
import pytest
from _mailbox_fake_s3 import Request, faulty_relay, s3_error
from _mailbox_memory import traced_get

from gradientmail.mailbox import MailboxUnavailable, S3Mailbox
from gradientmail.mailbox._s3_parts import MAX_PARTS, MIN_PART_BYTES, part_ranges

pytestmark = pytest.mark.usefixtures("aws_credentials")

PART = MIN_PART_BYTES


def small_parts(endpoint: str, bucket: str, **options: Any) -> S3Mailbox:
    """Parts of 5 MiB (S3's smallest) above a 5 MiB threshold, three at once."""
    return S3Mailbox(
        bucket,
        "run",
        endpoint_url=endpoint,
        part_size=PART,
        multipart_threshold=PART,
        part_concurrency=3,
        **options,
    )


def test_parts_cover_the_object_and_grow_past_ten_thousand() -> None:
    odd = [(0, PART), (PART, 2 * PART), (2 * PART, 2 * PART + 7)]
    assert part_ranges(2 * PART + 7, PART) == odd
    assert part_ranges(2 * PART, PART) == [(0, PART), (PART, 2 * PART)]
    many = part_ranges(MAX_PARTS * PART + 1, PART)
    assert len(many) == MAX_PARTS
    assert many[0][0] == 0
    assert many[-1][1] == MAX_PARTS * PART + 1
    assert all(end - start >= PART for start, end in many[:-1])
    with pytest.raises(ValueError, match="multipart limit"):
        part_ranges(MAX_PARTS * 5 * 2**30 + 1, PART)


def test_bad_transfer_options_are_refused() -> None:
    with pytest.raises(ValueError, match="part_size must be from"):
        S3Mailbox("bucket", part_size=PART - 1)
    with pytest.raises(ValueError, match="multipart_threshold must be from part_size"):
        S3Mailbox("bucket", part_size=2 * PART, multipart_threshold=PART)
    with pytest.raises(ValueError, match="multipart_threshold must be from part_size"):
        S3Mailbox("bucket", multipart_threshold=5 * 2**30 + 1)
    with pytest.raises(ValueError, match="part_concurrency must be at least 1"):
        S3Mailbox("bucket", part_concurrency=0)


def _uploads(admin: Any, bucket: str) -> list[Any]:
    return list(admin.list_multipart_uploads(Bucket=bucket).get("Uploads", ()))


@pytest.fixture
def admin(_moto_admin: Any) -> Any:
    return _moto_admin


@pytest.mark.anyio
async def test_objects_across_the_threshold_round_trip(
    moto_server: str, s3_bucket: str, admin: Any
) -> None:
    sizes = {"at": PART, "over": PART + 1, "odd": 2 * PART + 7}
    data = {name: os.urandom(size) for name, size in sizes.items()}
    async with (
        faulty_relay(moto_server) as (endpoint, log),
        small_parts(endpoint, s3_bucket) as box,
    ):
        for name, payload in data.items():
            assert await box.put_if_absent(name, payload)
        for name, payload in data.items():
            assert await box.get(name) == payload
            assert await box.get(name, max_bytes=len(payload)) == payload
    etags = {name: admin.head_object(Bucket=s3_bucket, Key=f"run/{name}")["ETag"] for name in data}
    # One PUT at the threshold; above it, one part per 5 MiB (the last one shorter).
    assert "-" not in etags["at"]
    assert etags["over"].endswith('-2"')
    assert etags["odd"].endswith('-3"')
    ranged = [r.headers["range"] for r in log.requests if "range" in r.headers]
    over = [f"bytes=0-{PART - 1}", f"bytes={PART}-{PART}"]
    odd = [
        f"bytes=0-{PART - 1}",
        f"bytes={PART}-{2 * PART - 1}",
        f"bytes={2 * PART}-{2 * PART + 6}",
    ]
    # Each large object read twice (with and without a cap), in parallel ranges.
    assert sorted(ranged) == sorted([*over, *odd] * 2)
    assert _uploads(admin, s3_bucket) == []


@pytest.mark.anyio
async def test_a_large_cap_reads_small_and_empty_objects_whole(
    moto_server: str, s3_bucket: str
) -> None:
    # A cap above the threshold makes the first GET a ranged one, which an empty object
    # refuses (416) and a small one answers whole.
    async with small_parts(moto_server, s3_bucket) as box:
        assert await box.put_if_absent("empty", b"")
        assert await box.put_if_absent("small", b"tiny")
        assert await box.get("empty", max_bytes=10 * PART) == b""
        assert await box.get("small", max_bytes=10 * PART) == b"tiny"
        assert await box.get("missing", max_bytes=10 * PART) is None


# The tests of conditional requests also run against Ceph's RADOS Gateway (``nox -s ceph``).
_STORES = ("moto", pytest.param("ceph", marks=pytest.mark.ceph))
_STORE_FIXTURES = {
    "moto": ("moto_server", "s3_bucket", "_moto_admin"),
    "ceph": ("ceph_server", "ceph_bucket", "_ceph_admin"),
}


def _store(request: pytest.FixtureRequest, store: str) -> tuple[str, str, Any]:
    """The endpoint, a fresh bucket and the admin client of ``store``."""
    server, bucket, admin = _STORE_FIXTURES[store]
    return (
        request.getfixturevalue(server),
        request.getfixturevalue(bucket),
        request.getfixturevalue(admin),
    )


@pytest.mark.anyio
@pytest.mark.parametrize("store", _STORES)
async def test_a_multipart_put_that_loses_the_race_creates_nothing(
    store: str, request: pytest.FixtureRequest
) -> None:
    upstream, bucket, admin = _store(request, store)
    held = anyio.Event()
    release = anyio.Event()

    async def hold_the_first_part(request: Request) -> bytes | None:
        if _is_part(request) and not held.is_set():
            held.set()
            await release.wait()
        return None

    late, early = os.urandom(PART + 100), os.urandom(PART + 200)
    outcome: list[bool] = []
    async with (
        faulty_relay(upstream, intercept=hold_the_first_part) as (endpoint, _),
        small_parts(endpoint, bucket) as box,
    ):

        async def put_late() -> None:
            outcome.append(await box.put_if_absent("blob", late))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                # Past its HEAD and into its parts before the other put starts...
                group.start_soon(put_late)
                await held.wait()
                # ...which completes first: the late one's conditional completion fails.
                assert await box.put_if_absent("blob", early)
                release.set()
        if store == "ceph":
            # Ceph 16.2's gateway ignores If-None-Match on CompleteMultipartUpload: the late
            # completion replaces the object (docs/mailbox.md, the table of stores).
            assert outcome == [True], "the gateway honours it now: update docs/mailbox.md"
            assert await box.get("blob") == late
        else:
            assert outcome == [False]
            assert await box.get("blob") == early
        # Once it exists, a HEAD settles it before any part is sent.
        assert await box.put_if_absent("blob", late) is False
    assert _uploads(admin, bucket) == []


@pytest.mark.anyio
@pytest.mark.parametrize("store", _STORES)
async def test_an_object_replaced_while_its_parts_are_read_is_never_spliced(
    store: str, request: pytest.FixtureRequest
) -> None:
    upstream, bucket, admin = _store(request, store)
    size = 2 * PART + 7
    first_part = f"bytes=0-{PART - 1}"
    held = anyio.Event()
    replaced = anyio.Event()

    async def hold_the_other_parts(request: Request) -> bytes | None:
        # The first part is read (from the original) before the others are asked for.
        if request.headers.get("range", first_part) != first_part:
            held.set()
            await replaced.wait()
        return None

    etags: list[str] = []

    def replace() -> None:
        etags.append(admin.head_object(Bucket=bucket, Key="run/blob")["ETag"])
        admin.delete_object(Bucket=bucket, Key="run/blob")
        admin.put_object(Bucket=bucket, Key="run/blob", Body=os.urandom(size))

    async def replace_while_held() -> None:
        await held.wait()
        await anyio.to_thread.run_sync(replace)
        replaced.set()

    async with (
        faulty_relay(upstream, intercept=hold_the_other_parts) as (endpoint, log),
        # Longer than the replacement takes: a held GET is never retried before it.
        small_parts(endpoint, bucket, read_timeout=60) as box,
    ):
        assert await box.put_if_absent("blob", os.urandom(size))
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(replace_while_held)
                with pytest.raises(MailboxUnavailable, match="changed while being read"):
                    await box.get("blob", max_bytes=size)
    # The other parts asked for the first part's ETag as the store sent it, quoted (Ceph
    # 16.2 matches an If-Match on a PUT only with the unquoted ETag, on a GET with either).
    others = [r for r in log.requests if r.headers.get("range", first_part) != first_part]
    assert len(others) == 2
    assert {r.headers.get("if-match") for r in others} == {etags[0]}
    assert etags[0].startswith('"')


def _is_part(request: Request) -> bool:
    return request.method == "PUT" and "partNumber=" in request.target


@pytest.mark.anyio
async def test_a_cancelled_upload_leaves_no_object_and_no_parts(
    moto_server: str, s3_bucket: str, admin: Any
) -> None:
    holding = anyio.Event()

    async def hold_the_second_part(request: Request) -> bytes | None:
        if _is_part(request) and "partNumber=2" in request.target:
            holding.set()
            await anyio.sleep_forever()
        return None

    async with (
        faulty_relay(moto_server, intercept=hold_the_second_part) as (endpoint, log),
        small_parts(endpoint, s3_bucket) as box,
    ):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(box.put_if_absent, "blob", os.urandom(3 * PART))
                await holding.wait()
                assert len(_uploads(admin, s3_bucket)) == 1
                group.cancel_scope.cancel()
        assert await box.get("blob") is None
    assert any(r.method == "DELETE" and "uploadId=" in r.target for r in log.requests)
    assert _uploads(admin, s3_bucket) == []


@pytest.mark.anyio
async def test_a_failing_part_aborts_the_upload(
    moto_server: str, s3_bucket: str, admin: Any
) -> None:
    async def fail_parts(request: Request) -> bytes | None:
        if _is_part(request):
            return s3_error(500, "Internal Server Error", "InternalError")
        return None

    async with (
        faulty_relay(moto_server, intercept=fail_parts) as (endpoint, _),
        small_parts(endpoint, s3_bucket) as box,
    ):
        with anyio.fail_after(60), pytest.raises(MailboxUnavailable, match="InternalError"):
            await box.put_if_absent("blob", os.urandom(2 * PART))
        assert await box.get("blob") is None
    assert _uploads(admin, s3_bucket) == []


@pytest.mark.anyio
async def test_a_parallel_read_fills_the_returned_bytes_without_a_second_buffer(
    moto_server: str, s3_bucket: str
) -> None:
    size = 6 * PART + 7
    data = os.urandom(size)
    async with small_parts(moto_server, s3_bucket) as box:
        assert await box.put_if_absent("blob", data)
        got, peak = await traced_get(box, "blob", size)
    assert got == data
    assert type(got) is bytes
    # The object once, plus what three ranges in flight hold; a buffer copied into the
    # returned bytes at the end would add the object's size again.
    assert peak < size + 2 * PART
