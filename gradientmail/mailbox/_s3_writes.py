"""``S3Mailbox``'s conditional writes: an object created once, by one PUT or by a multipart
upload, each conditional on the key's absence (``If-None-Match: *``).

The botocore errors that escape are the caller's to map (``S3Mailbox._boundary``).
"""

import logging
from typing import Any

import anyio
from botocore.exceptions import ClientError

from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox import _s3_parts
from gradientmail.mailbox._s3_client import RequestChecksums
from gradientmail.mailbox._s3_errors import error_code

__all__ = ["put_in_parts", "put_once"]

_CONFLICT_ATTEMPTS = 3

_log = logging.getLogger("gradientmail.mailbox.s3")


async def put_once(
    client: Any, limiter: anyio.CapacityLimiter, *, bucket: str, key: str, full: str, body: bytes
) -> bool:
    """Create ``full`` (the mailbox's ``key``) holding ``body`` by one conditional PUT; True
    iff this call created it. A 409 ``ConditionalRequestConflict`` (another conditional
    write in flight) is retried, ``_CONFLICT_ATTEMPTS`` in all, then raised as
    ``MailboxUnavailable``; any other ``ClientError`` propagates."""
    for _ in range(_CONFLICT_ATTEMPTS):
        try:
            async with limiter:
                await client.put_object(Bucket=bucket, Key=full, Body=body, IfNoneMatch="*")
        except ClientError as exc:
            code = error_code(exc)
            if code == "PreconditionFailed":
                return False
            if code != "ConditionalRequestConflict":
                raise
            _log.info("conditional write of %r conflicted; retrying", key)
        else:
            return True
    raise MailboxUnavailable(
        f"put {key!r}: conditional write conflicted {_CONFLICT_ATTEMPTS} times"
    )


async def put_in_parts(
    client: Any,
    limiter: anyio.CapacityLimiter,
    *,
    bucket: str,
    key: str,
    full: str,
    body: bytes,
    part_size: int,
    concurrency: int,
    checksums: RequestChecksums,
) -> bool:
    """Create ``full`` (the mailbox's ``key``) holding ``body`` by a multipart upload
    (``_s3_parts.upload``) after a HEAD that skips it when the object exists; True iff
    this call created it. A conflicting conditional completion is ``MailboxUnavailable``;
    any other ``ClientError`` propagates."""
    async with limiter:
        try:
            await client.head_object(Bucket=bucket, Key=full)
        except ClientError as exc:
            if error_code(exc) not in ("404", "NoSuchKey"):
                raise
        else:
            # Uploading gigabytes only to be refused at the completion is waste.
            return False
    try:
        return await _s3_parts.upload(
            client,
            limiter,
            bucket=bucket,
            key=full,
            data=body,
            part_size=part_size,
            concurrency=concurrency,
            checksums=checksums,
        )
    except ClientError as exc:
        if error_code(exc) == "ConditionalRequestConflict":
            raise MailboxUnavailable(f"put {key!r}: conditional write conflicted") from exc
        raise
