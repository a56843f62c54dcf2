"""A scripted HTTP endpoint for the S3 failure modes that moto cannot produce.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length bodies) for botocore: each request
is handed to a test-supplied ``answer`` coroutine, which returns the raw response, or None to
hang up without one, or waits (to hold the request in flight).
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Log:
    requests: list[Request] = field(default_factory=list)
    connections: int = 0


Answer = Callable[[Request], Awaitable[bytes | None]]


def response(status: int, reason: str, body: bytes = b"", *, xml: bool = True) -> bytes:
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(body)}\r\n"
    if xml:
        head += "Content-Type: application/xml\r\n"
    return head.encode() + b"\r\n" + body


def s3_error(status: int, reason: str, code: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>scripted {code}</Message></Error>"
    ).encode()
    return response(status, reason, body)


async def _read_request(stream: anyio.abc.ByteStream, buffer: bytearray) -> Request | None:
    while b"\r\n\r\n" not in buffer:
        try:
            chunk = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return None
        buffer.extend(chunk)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = bytearray(rest)
    while len(body) < length:
        try:
            body.extend(await stream.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return None
    buffer[:] = body[length:]
    return Request(method, target, headers, bytes(body[:length]))


@asynccontextmanager
async def fake_s3(answer: Answer) -> AsyncIterator[tuple[str, Log]]:
    """Serve ``answer`` on a free port of 127.0.0.1; yields the endpoint URL and the log."""
    log = Log()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        log.connections += 1
        buffer = bytearray()
        async with stream:
            while True:
                request = await _read_request(stream, buffer)
                if request is None:
                    return
                log.requests.append(request)
                reply = await answer(request)
                if reply is None:
                    return
                try:
                    await stream.send(reply)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return

    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}", log
        finally:
            group.cancel_scope.cancel()
