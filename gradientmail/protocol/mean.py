"""A round's deltas as the aggregation reads them, and their weighted mean.

A delta is tensors or a checked blob decoded piece by piece (``pieces.BlobView``, or a
``sparse.SparseBlob``): every pass takes ``pieces.CHUNK_ELEMENTS`` elements of each delta at
a time, never a decoded copy of a whole delta. The mean ``Σ wᵢ·Δᵢ`` is accumulated in fp32
in the order given, so every closer and every replay computes the same bits; a ``topk``
delta counts only at the elements it sent (``by_senders``): what it did not send is progress
its learner still holds, not a zero change, so each element's mean is over the deltas that
sent it.

Pure: no I/O; runs on whatever thread calls it (the syncer uses a worker thread).
"""

import math
from collections.abc import Iterator, Sequence
from typing import TypeAlias

import msgspec
import torch
from torch import Tensor

from gradientmail.protocol.codec import tensors_of
from gradientmail.protocol.pieces import FragmentBlob, PartedBlob, chunk_ranges
from gradientmail.protocol.records import BlobRef, FragmentSpec, RunConfig, Snapshot
from gradientmail.protocol.sparse import TOPK, SparseBlob

__all__ = [
    "Delta",
    "by_senders",
    "dense",
    "l2_norm",
    "mean_and_dots",
    "pairwise_distances",
    "piece_of",
    "sum_of_squares",
    "weighted_mean",
]

Delta: TypeAlias = Sequence[Tensor] | FragmentBlob | PartedBlob | SparseBlob
"""A snapshot's delta: its tensors (``spec.params`` order), or its checked blob (or parts)."""


def _pieces(delta: Delta) -> Iterator[Tensor]:
    """``delta`` as flat pieces of ``CHUNK_ELEMENTS`` (a parameter's last shorter), in order."""
    if isinstance(delta, FragmentBlob | PartedBlob | SparseBlob):
        for index, param in enumerate(delta.spec.params):
            for start, end in chunk_ranges(param.numel):
                yield delta.piece(index, start, end)
        return
    for tensor in delta:
        flat = tensor.detach().reshape(-1)
        for start, end in chunk_ranges(flat.numel()):
            yield flat[start:end]


def piece_of(delta: Delta, index: int, start: int, end: int) -> Tensor:
    """Elements ``[start, end)`` of parameter ``index`` of ``delta``, as fp32."""
    if isinstance(delta, FragmentBlob | PartedBlob | SparseBlob):
        return delta.piece(index, start, end)
    return delta[index].detach().reshape(-1)[start:end].to(torch.float32)


def dense(delta: Delta) -> list[Tensor]:
    """``delta`` as fp32 tensors (a blob decoded a piece at a time, ``codec.tensors_of``):
    one delta whole, for a caller that needs it so (``screening``)."""
    if isinstance(delta, FragmentBlob | PartedBlob | SparseBlob):
        return tensors_of(delta)
    return [tensor.detach().to(torch.float32) for tensor in delta]


def sum_of_squares(piece: Tensor) -> float:
    return float(torch.linalg.vector_norm(piece.to(torch.float64)) ** 2)


def l2_norm(tensors: Delta, *, minus: Sequence[Tensor] | None = None) -> float | None:
    """The L2 norm of ``tensors`` (less ``minus``, element by element in fp32: a learner's
    ``S − B`` without its copy) taken as one vector, summed in float64 a piece at a time;
    None if it is not finite. Learners put it in ``Snapshot.norm``; rounds recompute it."""
    pieces = _pieces(tensors)
    if minus is not None:
        pairs = zip(pieces, _pieces(minus), strict=True)
        pieces = (piece.to(torch.float32) - other for piece, other in pairs)
    norm = math.sqrt(math.fsum(sum_of_squares(piece) for piece in pieces))
    return norm if math.isfinite(norm) else None


def by_senders(snapshot: Snapshot, config: RunConfig) -> bool:
    """Whether ``snapshot``'s delta counts only at the elements it sent: a ``topk`` delta (every
    part ``topk``), whose unsent elements are progress its learner still holds, not a zero
    change; a dense delta counts everywhere. Under ``RunConfig.robust`` every delta counts
    everywhere, so no snapshot weighs more at an element than its bounded weight."""
    if config.robust:
        return False
    parts = () if isinstance(snapshot.parts, msgspec.UnsetType) else snapshot.parts
    refs = [snapshot.delta] if isinstance(snapshot.delta, BlobRef) else [p.delta for p in parts]
    return bool(refs) and all(ref.encoding == TOPK for ref in refs)


def weighted_mean(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    spec: FragmentSpec,
    sparse: Sequence[bool] | None = None,
) -> list[Tensor]:
    """``Σ wᵢ·Δᵢ`` accumulated in fp32 in the order given, a piece at a time: a round's mean,
    and the same bits again when a checkpoint's momentum is replayed from the record's
    weights (``protocol.checkpoint``). Where ``sparse`` marks a delta (``by_senders``), each
    element is divided by the weight of the deltas that sent it."""
    return mean_and_dots(deltas, weights, spec, cosines=False, sparse=sparse)[0]


def mean_and_dots(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    spec: FragmentSpec,
    *,
    cosines: bool,
    sparse: Sequence[bool] | None = None,
) -> tuple[list[Tensor], list[float] | None]:
    """``weighted_mean`` and (for two or more deltas, when ``cosines``) each delta's dot
    product with it in float64, in one pass a piece at a time. Each element sums the
    deltas in the order given, whatever the pieces, so both give the same bits."""
    mean = [torch.zeros(param.shape, dtype=torch.float32) for param in spec.params]
    cosines = cosines and len(deltas) >= 2
    dots: list[list[float]] = [[] for _ in deltas]
    only_sent = sparse if sparse is not None and any(sparse) else None
    for index, param in enumerate(spec.params):
        flat = mean[index].view(-1)
        for start, end in chunk_ranges(param.numel):
            pieces = [piece_of(delta, index, start, end) for delta in deltas]
            acc = flat[start:end]
            for piece, weight in zip(pieces, weights, strict=True):
                acc.add_(piece, alpha=weight)
            if only_sent is not None:
                acc.div_(_sent_weight(pieces, weights, only_sent))
            if cosines:
                wide = acc.double()
                for products, piece in zip(dots, pieces, strict=True):
                    products.append(float(torch.dot(piece.double(), wide)))
    return mean, [math.fsum(products) for products in dots] if cosines else None


def _sent_weight(
    pieces: Sequence[Tensor], weights: Sequence[float], sparse: Sequence[bool]
) -> Tensor:
    """Each element's ``Σ wᵢ`` over the deltas that sent it (a sparse one: where it is not
    zero; any other: everywhere), in the order given; 1 where none did."""
    total = torch.zeros_like(pieces[0])
    for piece, weight, only_sent in zip(pieces, weights, sparse, strict=True):
        if only_sent:
            total.add_((piece != 0).to(torch.float32), alpha=weight)
        else:
            total.add_(weight)
    return torch.where(total > 0, total, 1.0)


def pairwise_distances(deltas: Sequence[Delta], spec: FragmentSpec) -> list[list[float]]:
    """``‖Δᵢ − Δⱼ‖`` for every pair of ``deltas`` (fp32 differences, squares summed in
    float64), in one pass a piece at a time; ``inf`` where not finite."""
    count = len(deltas)
    squares: list[list[list[float]]] = [[[] for _ in deltas] for _ in deltas]
    for index, param in enumerate(spec.params):
        for start, end in chunk_ranges(param.numel):
            pieces = [piece_of(delta, index, start, end) for delta in deltas]
            for i in range(count):
                for j in range(i + 1, count):
                    squares[i][j].append(sum_of_squares(pieces[i] - pieces[j]))
    out = [[0.0] * count for _ in deltas]
    for i in range(count):
        for j in range(i + 1, count):
            distance = math.sqrt(math.fsum(squares[i][j]))
            out[i][j] = out[j][i] = distance if math.isfinite(distance) else math.inf
    return out
