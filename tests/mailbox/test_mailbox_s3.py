"""S3Mailbox beyond the shared contract: failure modes, limits, speed and resource hygiene.

Against moto where moto can play the part (a stopped or paused server, a missing bucket),
against a scripted HTTP endpoint where it cannot (409 conflicts, dropped connections,
refused access and credentials, per-key delete errors, a gateway that ignores StartAfter,
requests held in flight).
"""

import gc
import logging
import os
import pickle
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, Literal
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httpx
import pytest
from _mailbox_fake_s3 import Request, fake_s3, response, s3_error
from botocore.exceptions import ClientError

import gradientmail.mailbox.s3 as s3_module
from gradientmail.mailbox import MailboxUnavailable, ObjectTooLarge, S3Mailbox, _s3_client, retrying
from gradientmail.mailbox.s3 import S3AccessError

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("aws_credentials")]

# A stopped store must be reported within this many seconds, not hang.
BOUND = 10.0


def quick(endpoint: str, bucket: str = "bucket", *, max_concurrency: int = 8) -> S3Mailbox:
    """A mailbox with short timeouts, so that a silent server costs seconds, not minutes."""
    return S3Mailbox(
        bucket,
        "run",
        endpoint_url=endpoint,
        max_concurrency=max_concurrency,
        connect_timeout=0.5,
        read_timeout=0.5,
    )


async def test_an_in_memory_body_goes_out_in_pieces_of_a_mebibyte() -> None:
    """The request hook the S3 client's session installs hands httpx a large in-memory body
    as pieces of ``_SEND_CHUNK`` bytes, each one socket write (the stock session's piece
    per line of random bytes made a 64 MiB PUT crawl). What a large PUT costs next to the
    same requests made bare is ``benchmarks/bench_transfer.py``'s ``÷ raw``."""
    chunk = _s3_client._SEND_CHUNK
    data = os.urandom(5 * chunk + 123)
    # The httpx that aiobotocore sends with (its own copy, not the test's).
    request = _s3_client.httpx.Request("PUT", "http://127.0.0.1/bucket/key", content=data)
    await _s3_client._whole_body(request)
    pieces = [bytes(piece) async for piece in request.stream]
    assert [len(piece) for piece in pieces] == [chunk] * 5 + [123]
    assert b"".join(pieces) == data
    # Iterated again from its start, as httpcore does when it re-sends on a new connection.
    assert b"".join([bytes(piece) async for piece in request.stream]) == data


async def all_unavailable(operations: list[Callable[[], Awaitable[object]]]) -> None:
    """Run ``operations`` at once; each must raise MailboxUnavailable within ``BOUND``."""
    outcomes: list[BaseException | None] = []

    async def attempt(operation: Callable[[], Awaitable[object]]) -> None:
        try:
            await operation()
        except MailboxUnavailable as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as group:
            for operation in operations:
                group.start_soon(attempt, operation)
    assert len(outcomes) == len(operations)
    assert all(isinstance(error, MailboxUnavailable) for error in outcomes), outcomes


def every_operation(mailbox: S3Mailbox) -> list[Callable[[], Awaitable[object]]]:
    return [
        lambda: mailbox.put_if_absent("new", b"x"),
        lambda: mailbox.get("k"),
        lambda: mailbox.list(""),
        # Not "k": a request that timed out may still be carried out once the server answers.
        lambda: mailbox.delete(["other"]),
    ]


async def test_a_paused_then_stopped_server_is_unavailable_and_retrying_outlasts_it(
    moto_servers: Callable[[], Any],
) -> None:
    server = moto_servers()
    await _create_bucket(server.endpoint, "outage")
    async with quick(server.endpoint, "outage") as mailbox:
        assert await mailbox.put_if_absent("k", b"before")

        failed = anyio.Event()
        outcome: list[bytes | None] = []

        async def read() -> bytes | None:
            try:
                return await mailbox.get("k")
            except MailboxUnavailable:
                failed.set()
                raise

        async def keep_reading() -> None:
            outcome.append(await retrying(read, max_delay=1.0))

        # Paused: the kernel still accepts connections, nothing answers (read timeouts). The
        # retried read's first attempt runs alongside the others.
        server.pause()
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(keep_reading)
                await all_unavailable(every_operation(mailbox))
                await failed.wait()
                server.resume()
        assert outcome == [b"before"]

        # Stopped: connections are refused.
        server.stop()
        await all_unavailable(every_operation(mailbox))


async def _create_bucket(endpoint: str, name: str) -> None:
    async with httpx.AsyncClient() as plain:
        assert (await plain.put(f"{endpoint}/{name}")).status_code == 200


async def test_a_missing_bucket_is_named_with_its_endpoint_by_every_operation(
    moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "wJalrXUtnFEMI-a-secret-that-must-never-show"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    async with S3Mailbox("no-such-bucket-here", "run", endpoint_url=moto_server) as mailbox:
        for operation in every_operation(mailbox):
            with pytest.raises(S3AccessError) as caught:
                await operation()
            error = caught.value
            # Still a ClientError with botocore's response, for callers that catch those.
            assert isinstance(error, ClientError)
            assert isinstance(error.__cause__, ClientError)
            assert error.response["Error"]["Code"] == "NoSuchBucket"
            message = str(error)
            assert "'no-such-bucket-here'" in message
            assert moto_server in message
            assert "does not exist" in message
            assert "aws s3 mb s3://no-such-bucket-here" in message
            assert f"NoSuchBucket from {error.operation_name}" in message
            assert secret not in message + repr(error)


@pytest.mark.parametrize(
    ("status", "code", "advice"),
    [
        (403, "AccessDenied", "refused access"),
        (403, "InvalidAccessKeyId", "rejected the credentials"),
        (403, "SignatureDoesNotMatch", "rejected the credentials"),
        (400, "ExpiredToken", "rejected the credentials"),
        (400, "AuthorizationHeaderMalformed", "another region"),
    ],
)
async def test_refused_access_names_bucket_and_endpoint_never_a_credential(
    status: int, code: str, advice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_id, secret = "AKIAEXAMPLEKEYID0001", "wJalrXUtnFEMI-a-secret-that-must-never-show"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)

    async def refuse(request: Request) -> bytes:
        # S3 echoes the access key id in some error bodies: it must not reach the message.
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><Error>'
            f"<Code>{code}</Code><Message>refused for {key_id}</Message>"
            f"<AWSAccessKeyId>{key_id}</AWSAccessKeyId></Error>"
        ).encode()
        return response(status, "Refused", body)

    async with fake_s3(refuse) as (endpoint, _), quick(endpoint, "guarded") as mailbox:
        for operation in every_operation(mailbox):
            with anyio.fail_after(BOUND), pytest.raises(S3AccessError) as caught:
                await operation()
            error = caught.value
            assert error.response["Error"]["Code"] == code
            message = str(error)
            assert "'guarded'" in message
            assert endpoint in message
            assert advice in message
            assert code in message
            assert key_id not in message + repr(error)
            assert secret not in message + repr(error)


async def test_other_client_errors_propagate_unchanged() -> None:
    async def invalid(request: Request) -> bytes:
        return s3_error(400, "Bad Request", "InvalidArgument")

    async with fake_s3(invalid) as (endpoint, _), quick(endpoint) as mailbox:
        for operation in every_operation(mailbox):
            with anyio.fail_after(BOUND), pytest.raises(ClientError) as caught:
                await operation()
            assert not isinstance(caught.value, S3AccessError)
            assert caught.value.response["Error"]["Code"] == "InvalidArgument"


def test_an_endpoint_is_shown_without_user_or_password() -> None:
    mailbox = S3Mailbox("b", endpoint_url="https://user:hunter2@store.example:9000/base")
    assert "hunter2" not in repr(mailbox)
    assert "https://store.example:9000/base" in repr(mailbox)
    error = S3AccessError(
        {"Error": {"Code": "NoSuchBucket"}}, "GetObject", "b", "https://user:hunter2@h/"
    )
    assert "hunter2" not in str(error)
    assert "https://h/" in str(error)
    assert pickle.loads(pickle.dumps(error)).args == error.args


async def test_a_conflict_is_retried_three_times_then_unavailable() -> None:
    async def conflict(request: Request) -> bytes:
        return s3_error(409, "Conflict", "ConditionalRequestConflict")

    async with fake_s3(conflict) as (endpoint, log), quick(endpoint) as mailbox:
        with anyio.fail_after(BOUND), pytest.raises(MailboxUnavailable, match="conflicted 3"):
            await mailbox.put_if_absent("k", b"x")
    puts = [request for request in log.requests if request.method == "PUT"]
    assert len(puts) == 3
    assert all("/bucket/run/k" in request.target for request in puts)
    assert all(request.headers.get("if-none-match") == "*" for request in puts)


async def test_a_precondition_failure_means_not_created() -> None:
    async def exists(request: Request) -> bytes:
        return s3_error(412, "Precondition Failed", "PreconditionFailed")

    async with fake_s3(exists) as (endpoint, _), quick(endpoint) as mailbox:
        assert await mailbox.put_if_absent("k", b"x") is False


@pytest.mark.parametrize("behaviour", ["hang-up", "silence"])
async def test_dropped_and_silent_connections_are_unavailable(behaviour: str) -> None:
    async def misbehave(request: Request) -> bytes | None:
        if behaviour == "silence":
            await anyio.sleep_forever()
        return None

    async with fake_s3(misbehave) as (endpoint, log), quick(endpoint) as mailbox:
        await all_unavailable(every_operation(mailbox))
    # botocore's standard retries made three attempts at each.
    assert len(log.requests) == 3 * 4


async def test_per_key_delete_errors_are_raised() -> None:
    async def partial_failure(request: Request) -> bytes:
        assert request.method == "POST"
        assert request.target.endswith("?delete")
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>'
            b"<Error><Key>run/b</Key><Code>AccessDenied</Code><Message>no</Message></Error>"
            b"</DeleteResult>"
        )
        return response(200, "OK", body)

    async with fake_s3(partial_failure) as (endpoint, _), quick(endpoint) as mailbox:
        with pytest.raises(S3AccessError) as caught:
            await mailbox.delete(["a", "b"])
    assert caught.value.response["Error"]["Code"] == "AccessDenied"
    assert caught.value.response["Error"]["Key"] == "run/b"
    assert "'bucket'" in str(caught.value)


async def test_deletes_go_in_chunks_of_a_thousand() -> None:
    async def deleted(request: Request) -> bytes:
        body = b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult></DeleteResult>'
        return response(200, "OK", body)

    async with fake_s3(deleted) as (endpoint, log), quick(endpoint) as mailbox:
        await mailbox.delete(f"k/{index}" for index in range(2500))
    counts = [request.body.count(b"<Key>") for request in log.requests]
    assert counts == [1000, 1000, 500]


async def test_list_cuts_at_after_when_the_store_ignores_start_after() -> None:
    def listing(keys: list[str]) -> bytes:
        contents = "".join(
            f"<Contents><Key>{key}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f'<ETag>"e"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>'
            for key in keys
        )
        return (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>bucket</Name><Prefix>run/</Prefix><KeyCount>{len(keys)}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}"
            "</ListBucketResult>"
        ).encode()

    async def ignores_start_after(request: Request) -> bytes:
        return response(200, "OK", listing(["run/a/1", "run/a/2", "run/a/3"]))

    async with fake_s3(ignores_start_after) as (endpoint, log), quick(endpoint) as mailbox:
        assert list(await mailbox.list("a/", after="a/1")) == ["a/2", "a/3"]
    assert "start-after=run%2Fa%2F1" in log.requests[0].target


async def test_requests_in_flight_are_bounded_by_max_concurrency() -> None:
    in_flight = 0
    peak = 0
    full = anyio.Event()
    release = anyio.Event()

    async def held(request: Request) -> bytes:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 3:
            full.set()
        await release.wait()
        in_flight -= 1
        return s3_error(404, "Not Found", "NoSuchKey")

    async with fake_s3(held) as (endpoint, log), quick(endpoint, max_concurrency=3) as mailbox:
        got: list[bytes | None] = []

        async def get(index: int) -> None:
            got.append(await mailbox.get(f"k/{index}"))

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as group:
                for index in range(12):
                    group.start_soon(get, index)
                await full.wait()
                # Give a fourth request every chance to show up before letting them go.
                await anyio.sleep(0.2)
                assert in_flight == 3
                release.set()
    assert peak == 3
    assert got == [None] * 12
    assert len(log.requests) == 12


async def test_payloads_over_the_object_limit_are_refused_before_sending(
    moto_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Allocating 5 GiB in a test is not an option; the check reads the module's limit.
    monkeypatch.setattr(s3_module, "MAX_OBJECT_BYTES", 10)
    async with S3Mailbox(s3_bucket, endpoint_url=moto_server) as mailbox:
        with pytest.raises(ValueError, match="use more fragments"):
            await mailbox.put_if_absent("k", b"x" * 11)
        assert await mailbox.get("k") is None
        assert await mailbox.put_if_absent("k", b"x" * 10)


async def test_a_prefix_scopes_the_mailbox(moto_server: str, s3_bucket: str) -> None:
    async with (
        S3Mailbox(s3_bucket, "one", endpoint_url=moto_server) as one,
        S3Mailbox(s3_bucket, "/one/two/", endpoint_url=moto_server) as two,
        S3Mailbox(s3_bucket, "", endpoint_url=moto_server) as whole,
    ):
        assert two.prefix == "one/two/"
        assert await one.put_if_absent("k", b"1")
        assert await two.put_if_absent("k", b"2")
        assert list(await one.list("")) == ["k", "two/k"]
        assert list(await two.list("")) == ["k"]
        assert list(await whole.list("")) == ["one/k", "one/two/k"]
        assert await whole.get("one/two/k") == b"2"


async def test_keys_too_long_with_the_prefix_are_refused(moto_server: str, s3_bucket: str) -> None:
    async with S3Mailbox(s3_bucket, "p" * 100, endpoint_url=moto_server) as mailbox:
        with pytest.raises(ValueError, match="1024-byte key limit"):
            await mailbox.put_if_absent("k" * 1000, b"x")


def _sockets() -> int:
    fds = os.listdir("/proc/self/fd")
    count = 0
    for fd in fds:
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets through /proc")
async def test_closing_leaves_no_task_or_connection_behind() -> None:
    async def missing(request: Request) -> bytes:
        await anyio.sleep(0.05)
        return s3_error(404, "Not Found", "NoSuchKey")

    tasks = {task.id for task in anyio.get_running_tasks()}
    sockets = _sockets()
    async with fake_s3(missing) as (endpoint, log), quick(endpoint, max_concurrency=4) as mailbox:
        async with anyio.create_task_group() as group:
            for index in range(8):
                group.start_soon(mailbox.get, f"k/{index}")
        # The pool keeps its connections (and the server its ends of them) open.
        assert _sockets() >= sockets + 2 * log.connections
    assert log.connections == 4
    assert {task.id for task in anyio.get_running_tasks()} == tasks
    assert _sockets() == sockets


@asynccontextmanager
async def valve(
    upstream: str, *, hold: Literal["request", "response"], after: int
) -> AsyncIterator[tuple[str, anyio.Event]]:
    """A TCP relay to ``upstream`` that passes each connection's ``hold`` direction only up
    to the end of its HTTP head plus ``after`` body bytes, then stalls it (the peer waits,
    the connection stays open). Yields the relay's endpoint and an event set once a
    connection stalled, that is, once a request is certainly in flight."""
    address = urlsplit(upstream)
    assert address.hostname is not None
    assert address.port is not None
    held = anyio.Event()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def relay(
        source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, stall: bool
    ) -> None:
        head = bytearray()
        limit: int | None = None
        passed = 0
        while True:
            chunk = await source.receive()
            if stall and limit is None:
                head.extend(chunk)
                end = head.find(b"\r\n\r\n")
                if end >= 0:
                    limit = end + 4 + after
            if limit is not None and passed + len(chunk) >= limit:
                await sink.send(chunk[: limit - passed])
                held.set()
                await anyio.sleep_forever()
            await sink.send(chunk)
            passed += len(chunk)

    async def serve(client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp(address.hostname, address.port)
        async with client, server, anyio.create_task_group() as group:

            async def one_way(
                source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, stall: bool
            ) -> None:
                # Either side hanging up ends the connection.
                with suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    await relay(source, sink, stall)
                group.cancel_scope.cancel()

            group.start_soon(one_way, client, server, hold == "request")
            group.start_soon(one_way, server, client, hold == "response")

    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}", held
        finally:
            group.cancel_scope.cancel()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets through /proc")
@pytest.mark.parametrize("operation", ["put", "get", "list"])
async def test_a_request_cancelled_mid_flight_leaves_nothing_behind(
    operation: str, moto_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    large = os.urandom(8 * 2**20)
    async with S3Mailbox(s3_bucket, "run", endpoint_url=moto_server) as direct:
        if operation == "get":
            assert await direct.put_if_absent("large", large)
        if operation == "list":
            async with anyio.create_task_group() as group:
                for index in range(50):
                    group.start_soon(direct.put_if_absent, f"many/{index:03d}", b"x")
    requests: dict[str, Callable[[S3Mailbox], Awaitable[object]]] = {
        "put": lambda mailbox: mailbox.put_if_absent("large", large),
        "get": lambda mailbox: mailbox.get("large"),
        "list": lambda mailbox: mailbox.list("many/"),
    }
    # A PUT stalls while sending its body, a GET and a LIST (about 12 kB) while receiving
    # theirs; a small request after them passes.
    hold: Literal["request", "response"] = "request" if operation == "put" else "response"
    after = 1024 if operation == "list" else 64 * 2**10
    # Under trio an async generator collected unfinished is reported here, not raised.
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    tasks = {task.id for task in anyio.get_running_tasks()}
    sockets = _sockets()
    finished: list[object] = []

    async def request(mailbox: S3Mailbox) -> None:
        finished.append(await requests[operation](mailbox))

    async with (
        valve(moto_server, hold=hold, after=after) as (endpoint, held),
        S3Mailbox(s3_bucket, "run", endpoint_url=endpoint, max_concurrency=1) as mailbox,
    ):
        async with anyio.create_task_group() as group:
            group.start_soon(request, mailbox)
            with anyio.fail_after(BOUND):
                await held.wait()
            group.cancel_scope.cancel()
        assert finished == []
        # The one connection (and the limiter's one slot) came back: a timely answer, not
        # a pool timeout.
        with anyio.fail_after(BOUND):
            assert await mailbox.get("absent") is None
    gc.collect()
    assert [(hook.exc_value, hook.object) for hook in unraisable] == []
    assert {task.id for task in anyio.get_running_tasks()} == tasks
    assert _sockets() == sockets
    if operation == "put":
        async with S3Mailbox(s3_bucket, "run", endpoint_url=moto_server) as direct:
            assert await direct.get("large") is None


async def test_operations_need_the_mailbox_open(moto_server: str, s3_bucket: str) -> None:
    mailbox = S3Mailbox(s3_bucket, endpoint_url=moto_server)
    with pytest.raises(RuntimeError, match="not open"):
        await mailbox.get("k")
    async with mailbox:
        assert "open" in repr(mailbox)
        with pytest.raises(RuntimeError, match="already open"):
            await mailbox.__aenter__()
    with pytest.raises(RuntimeError, match="not open"):
        await mailbox.list("")


async def test_credentials_are_never_logged(
    moto_server: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "SECRETdoNotLog0123456789abcdefghijklmnop"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG)
    async with S3Mailbox(s3_bucket, endpoint_url=moto_server) as mailbox:
        assert await mailbox.put_if_absent("k", b"x")
        assert await mailbox.get("k") == b"x"
        assert "SECRET" not in repr(mailbox)
    assert caplog.records, "debug logging was captured"
    assert secret not in caplog.text


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="bucket"):
        S3Mailbox("", "p")
    with pytest.raises(ValueError, match="bucket"):
        S3Mailbox("a/b", "p")
    with pytest.raises(ValueError, match="max_concurrency"):
        S3Mailbox("bucket", max_concurrency=0)
    with pytest.raises(ValueError, match="request_checksums"):
        S3Mailbox("bucket", request_checksums="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid mailbox prefix"):
        S3Mailbox("bucket", "a/../b")


async def test_an_oversized_object_is_refused_before_its_body_is_read() -> None:
    async def huge(request: Request) -> bytes:
        # A head promising 256 MiB and none of the body: a reader that waited for the body
        # would time out instead of refusing.
        return (
            b"HTTP/1.1 200 OK\r\nContent-Length: 268435456\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n"
        )

    async with fake_s3(huge) as (endpoint, _), quick(endpoint) as mailbox:
        with anyio.fail_after(BOUND), pytest.raises(ObjectTooLarge) as caught:
            await mailbox.get("records/0", max_bytes=2**20)
    assert caught.value.size == 2**28


async def test_a_size_cap_on_moto(moto_server: str, s3_bucket: str) -> None:
    async with S3Mailbox(s3_bucket, endpoint_url=moto_server) as mailbox:
        assert await mailbox.put_if_absent("big", os.urandom(3 * 2**20))
        with pytest.raises(ObjectTooLarge):
            await mailbox.get("big", max_bytes=2**20)
        assert len(await mailbox.get("big", max_bytes=3 * 2**20) or b"") == 3 * 2**20


async def test_a_body_slower_than_the_timeout_to_send_is_sent_piece_by_piece() -> None:
    # 32 MiB read at 8 MiB/s: about four seconds to send, more than the timeout even less
    # what the sockets' buffers take at once, but each MiB goes out well within it. Sent as
    # one write, the timeout would cut the body.
    data = os.urandom(32 * 2**20)

    async def stored(request: Request) -> bytes:
        assert request.body == data
        return response(200, "OK", xml=False)

    async with (
        fake_s3(stored, read_rate=8 * 2**20) as (endpoint, log),
        S3Mailbox(
            "bucket",
            endpoint_url=endpoint,
            multipart_threshold=64 * 2**20,
            read_timeout=2.5,
            request_checksums="when_required",
        ) as mailbox,
    ):
        with anyio.fail_after(60):
            assert await mailbox.put_if_absent("slow", data)
    assert [r.method for r in log.requests] == ["PUT"]
