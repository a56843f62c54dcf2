"""``protocol.sizes``: the bound a reader checks declared blob sizes against holds for the
largest blob every encoding writes, and a snapshot over it is refused before any read."""

import pytest
import torch

from gradientmail.protocol import sparse
from gradientmail.protocol.codec import ENCODINGS, encode_fragment
from gradientmail.protocol.records import BlobRef, FragmentSpec, ParamSpec, Snapshot, SnapshotPart
from gradientmail.protocol.sizes import delta_problem, max_blob_bytes

SPEC = FragmentSpec(
    index=0,
    params=(
        ParamSpec(name="w", shape=(7, 3), dtype="float32"),
        ParamSpec(name="b", shape=(), dtype="float32"),
    ),
)


@pytest.mark.parametrize("encoding", [*ENCODINGS, sparse.TOPK])
def test_the_largest_blob_of_every_encoding_is_within_the_bound(encoding: str) -> None:
    tensors = [torch.randn(7, 3), torch.randn(())]
    densest = sparse.Sparsity(chunk=1, bits=8, density=1.0) if encoding == sparse.TOPK else None
    blob = encode_fragment(tensors, SPEC, encoding, block_size=1, sparsity=densest)  # type: ignore[arg-type]
    assert len(blob) <= max_blob_bytes(SPEC)


def test_parts_are_judged_by_their_rows_before_any_is_read() -> None:
    big = BlobRef(sha256="0" * 64, size=1 << 20, encoding="fp32")
    rows = ((0, 7), (0, 1))
    parts = (SnapshotPart(delta=big, rows=rows), SnapshotPart(delta=big, rows=((7, 7), (1, 1))))
    snapshot = Snapshot(
        learner="m", round=0, fragment=0, base_version=0, steps=1, tokens=1, norm=1.0, parts=parts
    )
    problem = delta_problem(snapshot, SPEC)
    assert problem is not None
    assert f"part 0 names a blob of {1 << 20} bytes" in problem
    fits = BlobRef(sha256="0" * 64, size=max_blob_bytes(SPEC), encoding="fp32")
    whole = Snapshot(
        learner="m", round=0, fragment=0, base_version=0, steps=1, tokens=1, norm=1.0, delta=fits
    )
    assert delta_problem(whole, SPEC) is None
