"""What a blob can weigh: the bound a reader checks a ref's declared size against before it
reads a byte, so that a snapshot naming blobs larger than its fragment or its parts' rows
costs no download (the store then caps each read at the declared size).

Pure: no I/O; runs on whatever thread calls it.
"""

from gradientmail.protocol.framing import MAX_HEADER_BYTES
from gradientmail.protocol.layout import check_parts, part_spec
from gradientmail.protocol.records import FragmentSpec, Snapshot

__all__ = ["delta_problem", "max_blob_bytes"]

_BYTES_PER_ELEMENT = 11
"""The most an element takes in any encoding: a ``topk`` element in a chunk of its own (an
I32 count, an F32 scale, an 8-bit code and at most a quarter byte of index codes); int8 with
block size 1 takes 5, fp32 4."""


def max_blob_bytes(spec: FragmentSpec) -> int:
    """The most bytes a well-formed blob of ``spec`` takes in any encoding and block size:
    the length prefix, the longest header the codec reads (``MAX_HEADER_BYTES``) and 11 bytes
    an element."""
    return 8 + MAX_HEADER_BYTES + _BYTES_PER_ELEMENT * spec.numel


def delta_problem(snapshot: Snapshot, spec: FragmentSpec) -> str | None:
    """None when every blob of ``snapshot``'s delta can be what it claims: its parts' rows
    hold the rows of ``spec`` once, in order (``layout.check_parts``), and each blob's
    declared size is within ``max_blob_bytes`` of its rows (of ``spec`` for a whole delta);
    else what is wrong, for the ``shape`` rejection. Decided from the snapshot alone, before
    any of its blobs is read."""
    if isinstance(snapshot.parts, tuple):
        rows = [part.rows for part in snapshot.parts]
        problem = check_parts(spec, rows)
        if problem is not None:
            return problem
        specs = [part_spec(spec, part) for part in rows]
    else:
        specs = [spec]
    for k, (ref, expected) in enumerate(zip(snapshot.blobs, specs, strict=True)):
        bound = max_blob_bytes(expected)
        if ref.size > bound:
            what = f"part {k}" if isinstance(snapshot.parts, tuple) else "the delta"
            return (
                f"{what} names a blob of {ref.size} bytes, but a blob of its "
                f"{expected.numel} elements takes at most {bound}"
            )
    return None
