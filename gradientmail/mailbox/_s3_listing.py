"""``S3Mailbox``'s ``list``: ``ListObjectsV2`` pages followed to the end, keys outside the
mailbox's prefix skipped, and ``after`` cut here too (a store may ignore ``StartAfter``).

The botocore errors that escape are the caller's to map (``S3Mailbox._boundary``).
"""

from typing import Any

import anyio

__all__ = ["list_s3_keys"]


async def list_s3_keys(
    client: Any,
    limiter: anyio.CapacityLimiter,
    *,
    bucket: str,
    root: str,
    prefix: str,
    after: str,
) -> list[str]:
    """The mailbox's keys (the store's keys below ``root``, ``root`` cut off) that start
    with ``prefix`` and sort after ``after``, in the store's order."""
    request: dict[str, Any] = {"Bucket": bucket, "Prefix": root + prefix}
    if after:
        request["StartAfter"] = root + after
    keys: list[str] = []
    while True:
        async with limiter:
            page = await client.list_objects_v2(**request)
        for item in page.get("Contents", ()):
            full = item.get("Key")
            if full is None or not full.startswith(root):
                continue
            key = full[len(root) :]
            # The store may ignore StartAfter; on one that honours it this cuts nothing.
            if key > after:
                keys.append(key)
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return keys
        request["ContinuationToken"] = token
