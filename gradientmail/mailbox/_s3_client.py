"""``S3Mailbox``'s client setup: the botocore session (its service models loaded once per
process), the client's configuration, and the httpx session that sends an in-memory body
in pieces of ``_SEND_CHUNK`` bytes (the module docstring of ``s3``, "Transport", says why).
"""

import io
from collections.abc import AsyncIterator
from typing import Any, Literal, Self

from aiobotocore._httpx import httpx
from aiobotocore.config import AioConfig
from aiobotocore.httpxsession import HttpxSession
from aiobotocore.session import get_session

__all__ = ["RequestChecksums", "client_config", "session"]

# A request body goes out in socket writes of this size, each under the write timeout.
_SEND_CHUNK = 1 << 20

RequestChecksums = Literal["when_supported", "when_required"]

# botocore's parsed service models (a few MB of JSON, read-only once loaded), shared by the
# mailboxes of this process so that only the first one pays for loading them.
_shared_loader: Any = None


def session() -> Any:
    """A fresh aiobotocore session, sharing this process's loaded service models."""
    global _shared_loader
    fresh = get_session()
    if _shared_loader is None:
        _shared_loader = fresh.get_component("data_loader")
    else:
        fresh.register_component("data_loader", _shared_loader)
    return fresh


class _Pieces:
    """Yields ``data`` in views of ``_SEND_CHUNK`` bytes, then stops; a plain object rather
    than an async generator, so that dropping it half-iterated leaves nothing for the
    collector to close."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._at = 0

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> memoryview:
        if self._at >= len(self._view):
            raise StopAsyncIteration
        piece = self._view[self._at : self._at + _SEND_CHUNK]
        self._at += len(piece)
        return piece


class _WholeBody(httpx.AsyncByteStream):  # type: ignore[misc]  # aiobotocore is untyped
    """An in-memory request body that httpcore iterates through ``_Pieces``.

    httpcore sends each piece as one socket write under the write timeout, so pieces of
    ``_SEND_CHUNK`` bound the rate a body needs to get through (a whole 16 MiB part would
    need 3 MiB/s under aiobotocore's 5 s default), while staying few enough to cost
    nothing (the stock session's piece per line of random bytes makes a 64 MiB PUT crawl).

    httpx's ``ByteStream`` iterates as an async generator; when a request is cancelled
    while its body is being written, httpcore drops that generator mid-iteration and trio
    reports it as a ``ResourceWarning`` once it is collected (encode/httpx#3686). Each
    iteration starts afresh, as httpcore re-sends a body on a new connection when the
    first one was dead before it could be used.
    """

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return _Pieces(self._data)


async def _whole_body(request: Any) -> None:
    # An httpx request hook: runs in the sending task, before the request goes out.
    if isinstance(request.stream, httpx.ByteStream):
        request.stream = _WholeBody(request.content)


class _WholeBodySession(HttpxSession):  # type: ignore[misc]  # aiobotocore is untyped
    """aiobotocore's httpx session, handing httpx an in-memory body as one ``bytes`` that
    a cancelled request can drop safely.

    The stock session iterates an ``io.BytesIO`` body (what botocore makes of ``bytes``)
    line by line with a checkpoint per line, which makes large random payloads crawl.
    The original body is put back afterwards, so botocore's retries can rewind it. Every
    in-memory body then goes out as a ``_WholeBody``.
    """

    def _make_async_client(self) -> Any:
        client = super()._make_async_client()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks["request"], _whole_body]}
        return client

    async def send(self, request: Any) -> Any:
        body = request.body
        if not isinstance(body, io.BytesIO):
            return await super().send(request)
        start = body.tell()
        whole = body.getvalue()
        request.body = whole[start:] if start else whole
        try:
            return await super().send(request)
        finally:
            request.body = body


def client_config(
    *,
    max_concurrency: int,
    connect_timeout: float,
    read_timeout: float,
    checksums: RequestChecksums,
) -> Any:
    """The client's ``AioConfig``: path-style addressing, botocore's standard retries,
    ``max_concurrency`` pooled connections, the timeouts for every attempt, and
    ``checksums`` for both the requests' and the responses' checksums."""
    return AioConfig(
        http_session_cls=_WholeBodySession,
        # Loading the models is blocking file I/O: aiobotocore does it in a worker thread.
        warm_up_loader_caches=True,
        retries={"mode": "standard"},
        max_pool_connections=max_concurrency,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        # aiobotocore's httpx session gives writes 5 s; a slow link is not a dead one.
        connector_args={"write_timeout": read_timeout},
        s3={"addressing_style": "path"},
        request_checksum_calculation=checksums,
        response_checksum_validation=checksums,
    )
