"""The peak Python allocation of one ``Mailbox.get``, for the tests that bound it."""

import tracemalloc

from gradientmail.mailbox import Mailbox


async def traced_get(box: Mailbox, key: str, size: int) -> tuple[bytes | None, int]:
    """``box.get(key, max_bytes=size)`` and the peak bytes ``tracemalloc`` saw during it."""
    tracemalloc.start()
    try:
        got = await box.get(key, max_bytes=size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return got, peak
