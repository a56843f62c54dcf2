"""A scripted HTTP endpoint for the S3 failure modes that moto cannot produce.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length bodies) for botocore: each request
is handed to a test-supplied ``answer`` coroutine, which returns the raw response, or None to
hang up without one, or waits (to hold the request in flight).
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

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


async def _read_request(
    stream: anyio.abc.ByteStream, buffer: bytearray, read_rate: float | None = None
) -> Request | None:
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
            chunk = await stream.receive(1 << 16)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return None
        body.extend(chunk)
        if read_rate is not None:
            # A slow link: the sender's socket fills and its writes wait.
            await anyio.sleep(len(chunk) / read_rate)
    buffer[:] = body[length:]
    return Request(method, target, headers, bytes(body[:length]))


@asynccontextmanager
async def fake_s3(
    answer: Answer, *, read_rate: float | None = None
) -> AsyncIterator[tuple[str, Log]]:
    """Serve ``answer`` on a free port of 127.0.0.1; yields the endpoint URL and the log.
    With ``read_rate``, request bodies are read at about that many bytes per second."""
    log = Log()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        log.connections += 1
        buffer = bytearray()
        async with stream:
            while True:
                request = await _read_request(stream, buffer, read_rate)
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


_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "expect",
        "te",
    }
)


@dataclass
class Burst:
    """Faults for a relay to inject: while ``remaining`` is positive, each request gets the
    next of ``faults`` (cycling, as raw responses) instead of reaching the store, and
    ``remaining`` counts down. ``injected`` counts the faults sent over the relay's life."""

    faults: list[bytes]
    remaining: int = 0
    injected: int = 0

    def start(self, requests: int) -> None:
        self.remaining = requests


@asynccontextmanager
async def faulty_relay(
    upstream: str, burst: Burst | None = None, intercept: Answer | None = None
) -> AsyncIterator[tuple[str, Log]]:
    """An HTTP relay on 127.0.0.1 to ``upstream`` (a real store) that answers with
    ``burst``'s faults while a burst lasts, else with what ``intercept`` returns (it may
    also wait, to hold the request), and forwards every other request unchanged, ``Host``
    header (and so the signature) included. Yields its endpoint URL and log."""
    import httpx

    burst = burst if burst is not None else Burst([])
    async with httpx.AsyncClient(base_url=upstream, timeout=60) as client:

        async def answer(request: Request) -> bytes:
            if intercept is not None and (reply := await intercept(request)) is not None:
                return reply
            if burst.remaining > 0:
                burst.remaining -= 1
                fault = burst.faults[burst.injected % len(burst.faults)]
                burst.injected += 1
                return fault
            headers = {k: v for k, v in request.headers.items() if k not in _HOP_BY_HOP}
            # botocore may send the absolute form (``http://host/path``): keep the path.
            parts = urlsplit(request.target)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            # Finished even when the relay closes meanwhile: a forward cut off mid-body leaves
            # httpx's body generator unfinished, which trio reports when it is collected.
            with anyio.fail_after(60, shield=True):
                forwarded = await client.request(
                    request.method, target, headers=headers, content=request.body
                )
            head = f"HTTP/1.1 {forwarded.status_code} {forwarded.reason_phrase}\r\n"
            for name, value in forwarded.headers.multi_items():
                if name.lower() not in _HOP_BY_HOP:
                    head += f"{name}: {value}\r\n"
            if request.method == "HEAD":
                length = forwarded.headers.get("content-length", "0")
            else:
                length = str(len(forwarded.content))
            head += f"Content-Length: {length}\r\n\r\n"
            body = b"" if request.method == "HEAD" else forwarded.content
            return head.encode("latin-1") + body

        async with fake_s3(answer) as (endpoint, log):
            yield endpoint, log
