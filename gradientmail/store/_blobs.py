"""Content-addressed blobs through a store's requests: written under their sha256, read back
no further than their ref declares and verified.

Every read is capped before a buffer is allocated: a whole blob at ``BlobRef.size`` (the
mailbox refuses a larger object unread, ``ObjectTooLarge``), an index at 32 bytes a chunk of
that size, a range within it. A blob larger than its ref, or anything at its key that is not
an object, raises ``CorruptBlob`` naming the key, the declared and the real size.

Runs in the node's tasks on the event loop; hashing of large payloads goes to a worker
thread.
"""

import hashlib
from collections.abc import Mapping, Sequence

import anyio.to_thread
import msgspec

from gradientmail.errors import CorruptBlob
from gradientmail.mailbox import ObjectRefused, ObjectTooLarge
from gradientmail.protocol import keys
from gradientmail.protocol.records import INDEX_CHUNK, BlobRef, Snapshot, chunk_index, chunks_of
from gradientmail.store._requests import Requests

__all__ = ["Blobs", "hashed", "sha256"]

_HASH_INLINE_BYTES = 1 << 16
"""Payloads up to this size are hashed on the event loop; larger ones in a worker thread."""


def sha256(data: bytes) -> str:
    """The lowercase hex sha256 of ``data``: the name of its blob."""
    return hashlib.sha256(data).hexdigest()


async def hashed(data: bytes) -> str:
    """``sha256(data)``, in a worker thread for large ``data``."""
    if len(data) <= _HASH_INLINE_BYTES:
        return sha256(data)
    return await anyio.to_thread.run_sync(sha256, data)


class Blobs:
    """The run's blobs through ``requests`` (see the module docstring)."""

    def __init__(self, requests: Requests) -> None:
        self._requests = requests

    async def put_blob(self, data: bytes, encoding: str, *, indexed: bool = False) -> BlobRef:
        """Store ``data`` under its sha256 (a no-op when it is there) and return its ref;
        ``indexed``: with its chunk index (``BlobRef.index``), stored first, so that a ref
        never names an index that is not there."""
        digest = await hashed(data)
        index: str | msgspec.UnsetType = msgspec.UNSET
        if indexed:
            chunks = await anyio.to_thread.run_sync(chunk_index, data)
            named = await hashed(chunks)
            await self._requests.create(keys.blob(named), chunks, read_back=False)
            index = named
        # Content-addressed: whoever wrote the key wrote these bytes; nothing to read back.
        await self._requests.create(keys.blob(digest), data, read_back=False)
        return BlobRef(sha256=digest, size=len(data), encoding=encoding, index=index)

    async def _capped(self, key: str, size: int) -> bytes | None:
        """The object at ``key`` if it holds at most ``size`` bytes; None when it is gone."""
        try:
            return await self._requests.get(key, max_bytes=size)
        except ObjectTooLarge as exc:
            raise CorruptBlob(
                f"{key} holds {exc.size} bytes or more, but its reference declares {size}; it was "
                "not read: the store's copy is damaged or was planted"
            ) from None
        except ObjectRefused as exc:
            raise CorruptBlob(f"{key} cannot be read as a blob: {exc}") from None

    async def get_blob(self, ref: BlobRef, *, most: int | None = None) -> bytes | None:
        """The bytes of ``ref``, verified; None when the blob is gone (collected). No more
        than ``ref.size`` bytes are read, and nothing when ``ref.size`` exceeds ``most`` (what
        the reader knows a blob of its kind takes at most, ``sizes.max_blob_bytes``).

        Raises ``CorruptBlob`` when ``ref.size`` exceeds ``most`` or the object is larger than
        ``ref.size`` (both unread), or its bytes do not hash to ``ref.sha256`` or fall short of
        ``ref.size``.
        """
        key = keys.blob(ref.sha256)
        if most is not None and ref.size > most:
            raise CorruptBlob(
                f"{key}: its reference declares {ref.size} bytes, more than the {most} a blob of "
                "its fragment takes; it was not read"
            )
        data = await self._capped(key, ref.size)
        if data is None:
            return None
        digest = await hashed(data)
        if digest != ref.sha256 or len(data) != ref.size:
            raise CorruptBlob(
                f"{key} holds {len(data)} bytes hashing to {digest[:16]}…, but its reference "
                f"declares {ref.size}: the store's copy is damaged"
            )
        return data

    async def delta_blobs(self, snapshot: Snapshot) -> list[bytes] | None:
        """The verified bytes of every blob of ``snapshot``'s delta (``Snapshot.blobs``), in
        order, each read as ``get_blob`` reads it; None when one of them is gone. Raises
        ``CorruptBlob``. The caller checks the declared sizes first (``sizes.delta_problem``)."""
        found = []
        for ref in snapshot.blobs:
            data = await self.get_blob(ref)
            if data is None:
                return None
            found.append(data)
        return found

    async def blob_ranges(
        self, ref: BlobRef, ranges: Sequence[tuple[int, int]]
    ) -> list[bytes] | None:
        """The bytes of each ``[start, end)`` of ``ref`` in ``ranges`` (within its size),
        each checked against the blob's index: the index is read and checked against its
        address, then every chunk a range touches is read once and checked. A ref without an
        index is read whole (``get_blob``). None when the blob or its index is gone. Raises
        ``CorruptBlob`` for bytes that fail a check and ``ValueError`` for a range outside
        the blob."""
        for start, end in ranges:
            if not 0 <= start <= end <= ref.size:
                raise ValueError(f"range [{start}, {end}) is outside blob {ref.sha256[:16]}…")
        if not isinstance(ref.index, str):
            whole = await self.get_blob(ref)
            return None if whole is None else [whole[start:end] for start, end in ranges]
        index = await self._capped(keys.blob(ref.index), 32 * chunks_of(ref.size))
        if index is None:
            return None
        if await hashed(index) != ref.index or len(index) != 32 * chunks_of(ref.size):
            raise CorruptBlob(
                f"the index of blob {ref.sha256[:16]}… does not hash to {ref.index[:16]}… or "
                "has the wrong length; the store's copy is damaged"
            )
        chunks: dict[int, bytes] = {}
        for first, last in _chunk_runs(ranges):
            start, end = first * INDEX_CHUNK, min((last + 1) * INDEX_CHUNK, ref.size)
            data = await self._requests.get_range(keys.blob(ref.sha256), start, end)
            if data is None:
                return None
            for n in range(first, last + 1):
                chunk = data[(n - first) * INDEX_CHUNK : (n - first + 1) * INDEX_CHUNK]
                if hashlib.sha256(chunk).digest() != index[32 * n : 32 * n + 32]:
                    raise CorruptBlob(
                        f"bytes [{n * INDEX_CHUNK}, {n * INDEX_CHUNK + len(chunk)}) of blob "
                        f"{ref.sha256[:16]}… fail their digest in its index; the store's "
                        "copy is damaged"
                    )
                chunks[n] = chunk
        return [_assembled(chunks, start, end) for start, end in ranges]


def _chunk_runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The index chunks ``ranges`` touch, as runs ``(first, last)`` of adjacent chunks."""
    touched = sorted(
        {
            n
            for start, end in ranges
            if end > start
            for n in range(start // INDEX_CHUNK, (end - 1) // INDEX_CHUNK + 1)
        }
    )
    runs: list[tuple[int, int]] = []
    for n in touched:
        if runs and runs[-1][1] == n - 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs


def _assembled(chunks: Mapping[int, bytes], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a blob from its checked ``chunks``."""
    if end <= start:
        return b""
    first, last = start // INDEX_CHUNK, (end - 1) // INDEX_CHUNK
    joined = b"".join(chunks[n] for n in range(first, last + 1))
    return joined[start - first * INDEX_CHUNK : end - first * INDEX_CHUNK]
