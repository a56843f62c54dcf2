"""Large objects in parts: a multipart upload with parallel parts, and parallel ranged GETs.

Used by ``S3Mailbox`` for objects above its ``multipart_threshold``; the caller maps the
botocore errors that escape (``S3Mailbox._boundary``). Every request holds a slot of the
mailbox's limiter and of a per-object limiter (``concurrency``), so one transfer never
has more than ``concurrency`` requests in flight nor the mailbox more than its own bound.
Runs in the calling task; parts run in a task group of its own, so cancellation or a
failed part cancels the others and nothing outlives the call.
"""

import logging
import math
from functools import partial
from typing import Any, Literal

import anyio
from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

from gradientmail._bytes import Filling
from gradientmail._concurrent import gather
from gradientmail.errors import MailboxUnavailable

__all__ = ["MAX_PARTS", "MIN_PART_BYTES", "download", "part_ranges", "upload"]

MIN_PART_BYTES = 5 * 2**20
"""S3's smallest part (but the last)."""
MAX_PARTS = 10_000
"""S3's most parts in one upload."""
_MAX_PART_BYTES = 5 * 2**30
_READ_CHUNK = 1 << 16
# How long an abort may take once the upload failed or was cancelled.
_ABORT_SECONDS = 10.0

_log = logging.getLogger("gradientmail.mailbox.s3")


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges covering ``size`` bytes in parts of ``part_size`` (the
    last shorter), grown evenly where ``size`` would need more than ``MAX_PARTS`` parts.

    Raises ``ValueError`` when ``size`` needs parts over S3's 5 GiB part limit.
    """
    part = max(part_size, math.ceil(size / MAX_PARTS))
    if part > _MAX_PART_BYTES:
        raise ValueError(f"{size} bytes exceed S3's multipart limit of {MAX_PARTS} 5 GiB parts")
    return [(start, min(start + part, size)) for start in range(0, size, part)]


def _code(exc: ClientError) -> str | None:
    code = exc.response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


async def upload(
    client: Any,
    limiter: anyio.CapacityLimiter,
    *,
    bucket: str,
    key: str,
    data: bytes,
    part_size: int,
    concurrency: int,
    checksums: Literal["when_supported", "when_required"],
) -> bool:
    """Create ``key`` holding ``data`` by a multipart upload, ``concurrency`` parts at once;
    True iff this call created it. The completion is conditional (``If-None-Match: *``):
    an object already there is left untouched and False returned.

    Whatever ends the upload early (a failed part, a refused completion, cancellation)
    aborts it, shielded and bounded, so no part is left stored: an abort that fails in turn
    is logged (a lifecycle rule ``AbortIncompleteMultipartUpload`` collects such parts).
    """
    create: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if checksums == "when_supported":
        # Each part then carries a CRC32 that the store checks, as a single PUT does.
        create["ChecksumAlgorithm"] = "CRC32"
    async with limiter:
        upload_id = (await client.create_multipart_upload(**create))["UploadId"]
    done = False
    try:
        parts = await _send_parts(
            client, limiter, bucket, key, upload_id, data, part_size, concurrency
        )
        async with limiter:
            try:
                await client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
            except ClientError as exc:
                if _code(exc) == "PreconditionFailed":
                    return False
                raise
        done = True
        return True
    finally:
        if not done:
            await _abort(client, bucket, key, upload_id)


async def _send_parts(
    client: Any,
    limiter: anyio.CapacityLimiter,
    bucket: str,
    key: str,
    upload_id: str,
    data: bytes,
    part_size: int,
    concurrency: int,
) -> list[dict[str, Any]]:
    """Upload every part of ``data``; the parts' descriptions for the completion, in order."""
    ranges = part_ranges(len(data), part_size)
    parts: list[dict[str, Any]] = [{} for _ in ranges]
    per_object = anyio.CapacityLimiter(concurrency)

    async def send(number: int, start: int, end: int) -> None:
        async with per_object, limiter:
            # The slice is a copy: at most ``concurrency`` of them exist at once.
            reply = await client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data[start:end],
            )
        part = {"ETag": reply["ETag"], "PartNumber": number}
        if "ChecksumCRC32" in reply:
            part["ChecksumCRC32"] = reply["ChecksumCRC32"]
        parts[number - 1] = part

    await gather(
        [partial(send, number, start, end) for number, (start, end) in enumerate(ranges, start=1)]
    )
    return parts


async def _abort(client: Any, bucket: str, key: str, upload_id: str) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_ABORT_SECONDS) as scope:
        try:
            await client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except (ClientError, ConnectionError, HTTPClientError) as exc:
            _log.warning(
                "could not abort the multipart upload %s of %r (%s): its parts stay stored "
                "until a lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                upload_id,
                key,
                exc,
            )
    if scope.cancelled_caught:
        _log.warning(
            "aborting the multipart upload %s of %r took over %.0f s; its parts may stay "
            "stored until a lifecycle rule (AbortIncompleteMultipartUpload) removes them",
            upload_id,
            key,
            _ABORT_SECONDS,
        )


class _Gone(Exception):
    """The object was deleted while its parts were being read."""


async def download(
    client: Any,
    limiter: anyio.CapacityLimiter,
    *,
    bucket: str,
    key: str,
    size: int,
    etag: str,
    part_size: int,
    concurrency: int,
    first: bytes = b"",
) -> bytes | None:
    """The ``size`` bytes of ``key``, starting with the ``first`` already read, the rest
    read by ranged GETs, ``concurrency`` at once, each conditional on ``etag`` (so parts of
    two versions are never spliced), straight into the ``bytes`` returned (``Filling``: no
    second whole-object buffer); None when the object is deleted meanwhile.

    Raises ``MailboxUnavailable`` when the object changed (412) or a range came back short.
    """
    out = Filling(size)
    view = out.view
    view[: len(first)] = first
    per_object = anyio.CapacityLimiter(concurrency)

    async def fetch(start: int, end: int) -> None:
        async with per_object, limiter:
            try:
                response = await client.get_object(
                    Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=etag
                )
            except ClientError as exc:
                if _code(exc) == "NoSuchKey":
                    raise _Gone from None
                if _code(exc) == "PreconditionFailed":
                    raise MailboxUnavailable(f"get {key!r}: it changed while being read") from exc
                raise
            at = start
            async with response["Body"] as body:
                async for chunk in body.iter_chunks(_READ_CHUNK):
                    if at + len(chunk) > end:
                        break
                    view[at : at + len(chunk)] = chunk
                    at += len(chunk)
        if at != end:
            raise MailboxUnavailable(
                f"get {key!r}: bytes {start}-{end - 1} came back as {at - start} bytes"
            )

    try:
        skip = len(first)
        ranges = part_ranges(size - skip, part_size)
        await gather([partial(fetch, skip + start, skip + end) for start, end in ranges])
    except _Gone:
        return None
    return out.done()
