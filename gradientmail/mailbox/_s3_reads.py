"""``S3Mailbox``'s reads: a whole object by one GET, or, for a large one, its first part
and then the rest by parallel ranged GETs (``_s3_parts.download``); a range of one by one
ranged GET, kept to the range even from a store that ignores ``Range``. A read capped at
``max_bytes`` stops as soon as the object proves larger.

The botocore errors that escape are the caller's to map (``S3Mailbox._boundary``).
"""

from typing import Any

import anyio
from botocore.exceptions import ClientError

from gradientmail.mailbox import _s3_parts
from gradientmail.mailbox._base import ObjectTooLarge
from gradientmail.mailbox._s3_errors import error_code

__all__ = ["get_object", "get_range"]


def _object_size(response: Any) -> int | None:
    """The whole object's size: from ``Content-Range`` (``bytes 0-9/1234``) for a part of
    it, else the response's length; None when the store stated neither."""
    content_range = response.get("ContentRange")
    if content_range:
        total = content_range.rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = response.get("ContentLength")
    return int(length) if length is not None else None


async def _read_at_most(stream: Any, key: str, max_bytes: int) -> bytes:
    """The whole body of a response that did not state its length, read in chunks and
    abandoned (``ObjectTooLarge``) as soon as it exceeds ``max_bytes``."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in stream.iter_chunks(1 << 20):
        total += len(chunk)
        if total > max_bytes:
            raise ObjectTooLarge(key, total, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_prefix(stream: Any, size: int) -> bytes:
    """The first ``size`` bytes of a body (fewer when it is shorter); the rest is not read
    (closing the response drops its connection)."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in stream.iter_chunks(1 << 20):
        chunks.append(chunk)
        total += len(chunk)
        if total >= size:
            break
    return b"".join(chunks)[:size]


async def get_object(
    client: Any,
    limiter: anyio.CapacityLimiter,
    *,
    bucket: str,
    key: str,
    full: str,
    max_bytes: int | None,
    threshold: int,
    part_size: int,
    concurrency: int,
) -> bytes | None:
    """The object ``full`` (the mailbox's ``key``), None when there is none; one over
    ``threshold`` bytes is read in parts of ``part_size``, ``concurrency`` at once. Raises
    ``ObjectTooLarge`` for one over ``max_bytes``."""
    # A caller allowing more than the threshold expects a large object (a blob of known
    # size): ask for the first part only, which tells the size, and fetch the rest in
    # parallel. Others (records) get one plain GET, whose checksum botocore validates.
    ranged = max_bytes is not None and max_bytes > threshold
    async with limiter:
        response = await _first_response(client, bucket, full, ranged, part_size)
        if response is None:
            return None
        # Leaving this block unread closes the response (and drops its connection).
        async with response["Body"] as stream:
            size = _object_size(response)
            if max_bytes is not None:
                if size is None:
                    return await _read_at_most(stream, key, max_bytes)
                if size > max_bytes:
                    raise ObjectTooLarge(key, size, max_bytes)
            if size is None:
                data: bytes = await stream.read()
                return data
            total: int = size
            # A first part (which may be all of it), or a small object: read it.
            if "ContentRange" in response or total <= threshold:
                data = await stream.read()
                if len(data) >= total:
                    return data
            else:
                data = b""
    return await _s3_parts.download(
        client,
        limiter,
        bucket=bucket,
        key=full,
        size=total,
        etag=response["ETag"],
        part_size=part_size,
        concurrency=concurrency,
        first=data,
    )


async def get_range(
    client: Any,
    limiter: anyio.CapacityLimiter,
    *,
    bucket: str,
    key: str,
    full: str,
    start: int,
    end: int,
) -> bytes | None:
    """Bytes ``[start, end)`` of the object ``full`` (the mailbox's ``key``), fewer where it
    ends before ``end``; None when there is no such object."""
    async with limiter:
        request = {"Bucket": bucket, "Key": full, "Range": f"bytes={start}-{end - 1}"}
        try:
            response = await client.get_object(**request)
        except ClientError as exc:
            code = error_code(exc)
            if code == "NoSuchKey":
                return None
            if code == "InvalidRange":
                return b""  # the object ends at or before ``start``
            raise
        async with response["Body"] as stream:
            if "ContentRange" in response:
                return await _read_at_most(stream, key, end - start)
            # A store that ignores Range answers the whole object: keep the range.
            return (await _read_prefix(stream, end))[start:end]


async def _first_response(client: Any, bucket: str, full: str, ranged: bool, part_size: int) -> Any:
    """The response to the GET of ``full`` (its first part when ``ranged``), or None
    when there is no such object."""
    request = {"Bucket": bucket, "Key": full}
    if ranged:
        request["Range"] = f"bytes=0-{part_size - 1}"
    try:
        return await client.get_object(**request)
    except ClientError as exc:
        code = error_code(exc)
        if code == "NoSuchKey":
            return None
        if code == "InvalidRange":
            # An empty object has no first byte to range over.
            return await _first_response(client, bucket, full, False, part_size)
        raise
