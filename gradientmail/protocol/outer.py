"""The outer step of a round and the update every learner applies.

The outer optimizer is Nesterov momentum SGD on ``g = −Δ̄``, written with the very torch
operations of ``torch.optim.SGD(lr, momentum, nesterov=True)`` so that it matches it bit for
bit in fp32 (with ``μ = 0``, plain SGD; the formulas: docs/protocol.md, "The outer step").
The committed version is ``θ_{v+1} = θ + decode(encode(U))``, ``U = θ' − θ`` in the run's
update encoding, so a learner holding ``θ_v`` that applies the update with ``apply_update``
computes the same bits. ``final_step`` commits ``θ + Δ̄`` with the momentum unchanged (a final
round); a round that accepts no snapshot commits θ as it is (``committed_update(θ, θ, …)``).

Pure: no I/O; runs on whatever thread calls it (the syncer uses a worker thread). Inputs are
never modified. Memory: the tensors returned (and the update blob) plus a few pieces of
``pieces.CHUNK_ELEMENTS`` elements, never a whole temporary.
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradientmail.protocol.codec import encode_fragment, open_fragment
from gradientmail.protocol.pieces import chunk_ranges
from gradientmail.protocol.records import Encoding, FragmentSpec
from gradientmail.protocol.sparse import Sparsity

__all__ = ["added", "apply_update", "committed_update", "final_step", "outer_step"]


def _same_shapes(what: str, left: Sequence[Tensor], right: Sequence[Tensor]) -> None:
    if len(left) != len(right):
        raise ValueError(f"{what}: {len(left)} tensors against {len(right)}")
    for i, (a, b) in enumerate(zip(left, right, strict=True)):
        if a.shape != b.shape:
            raise ValueError(
                f"{what}: tensor {i} has shape {list(a.shape)} against {list(b.shape)}"
            )


def outer_step(
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    mean_delta: Sequence[Tensor],
    *,
    lr: float,
    momentum_coef: float,
) -> tuple[list[Tensor], list[Tensor]]:
    """``(θ', m')``: one Nesterov step from ``theta`` with the pseudo-gradient ``−mean_delta``.

    ``momentum`` None is the first step (the buffer starts as ``g``, as torch's does). All
    tensors are fp32; new tensors are returned. Raises ``ValueError`` for mismatched tensors,
    a non-positive or non-finite ``lr`` or a ``momentum_coef`` outside [0, 1].
    """
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"outer lr must be positive and finite, got {lr!r}")
    if not 0 <= momentum_coef <= 1:
        raise ValueError(f"outer momentum must be in [0, 1], got {momentum_coef!r}")
    _same_shapes("theta and mean_delta", theta, mean_delta)
    if momentum is not None:
        _same_shapes("theta and momentum", theta, momentum)
    raw: list[Tensor] = []
    buffers: list[Tensor] = []
    for i, (param, delta) in enumerate(zip(theta, mean_delta, strict=True)):
        raw.append(torch.empty(param.shape, dtype=param.dtype))
        buffers.append(torch.empty(param.shape, dtype=delta.dtype))
        flat, mean = param.reshape(-1), delta.reshape(-1)
        previous = None if momentum is None else momentum[i].reshape(-1)
        for start, end in chunk_ranges(flat.numel()):
            grad = torch.neg(mean[start:end])
            buf = (
                grad.clone()
                if previous is None
                else previous[start:end].mul(momentum_coef).add(grad)
            )
            step = grad.add(buf, alpha=momentum_coef)
            raw[i].view(-1)[start:end] = flat[start:end].add(step, alpha=-lr)
            buffers[i].view(-1)[start:end] = buf
    return raw, buffers


def final_step(
    theta: Sequence[Tensor], momentum: Sequence[Tensor] | None, mean_delta: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """``(θ + Δ̄, m)``: a final round's raw θ' (the mean of the closing learners' models, no
    outer step) and the momentum unchanged (zeros when ``momentum`` is None: no step yet).
    Raises ``ValueError`` for mismatched tensors."""
    _same_shapes("theta and mean_delta", theta, mean_delta)
    if momentum is not None:
        _same_shapes("theta and momentum", theta, momentum)
    raw = [param.add(delta) for param, delta in zip(theta, mean_delta, strict=True)]
    kept = (
        [m.clone() for m in momentum]
        if momentum is not None
        else [torch.zeros_like(t) for t in theta]
    )
    return raw, kept


def apply_update(theta: Sequence[Tensor], update: bytes, spec: FragmentSpec) -> list[Tensor]:
    """``θ + decode(update)``: the next version of a fragment from the update blob of its
    round. Learners and the syncer both use it, so they hold the same bits. Raises
    ``CodecError`` for a malformed blob and ``ValueError`` if ``theta`` does not match."""
    blob = open_fragment(update, spec)
    shapes = [torch.empty(param.shape, device="meta") for param in spec.params]
    _same_shapes("theta and the update", theta, shapes)
    result = []
    for index, param in enumerate(theta):
        flat = param.reshape(-1)
        out = torch.empty(param.shape, dtype=torch.promote_types(param.dtype, torch.float32))
        for start, end in chunk_ranges(flat.numel()):
            out.view(-1)[start:end] = flat[start:end].add(blob.piece(index, start, end))
        result.append(out)
    return result


def added(theta: Sequence[Tensor], update: Sequence[Tensor]) -> list[Tensor]:
    """``θ + U`` from decoded update tensors (rows of a fragment, say): the bits
    ``apply_update`` gives for the same elements. Raises ``ValueError`` for tensors of
    other shapes."""
    _same_shapes("theta and the update", theta, update)
    return [
        t.to(torch.promote_types(t.dtype, torch.float32)).add(u)
        for t, u in zip(theta, update, strict=True)
    ]


def committed_update(
    theta: Sequence[Tensor],
    raw: Sequence[Tensor],
    spec: FragmentSpec,
    encoding: Encoding,
    *,
    block_size: int,
    version: int,
    sparsity: Sparsity | None = None,
) -> tuple[bytes, list[Tensor]]:
    """``(update blob, θ_{v+1})``: ``U = raw − θ`` encoded in ``encoding`` as a blob of
    ``version`` (``v + 1``), and ``θ_{v+1} = θ + decode(U)`` (``apply_update``), the version
    the round commits.
    ``topk`` needs ``sparsity`` (``sparse.update_sparsity``: every non-zero element of ``U``).

    Raises ``ValueError`` if the tensors do not match ``spec`` or each other.
    """
    _same_shapes("theta and raw", theta, raw)
    blob = encode_fragment(
        raw, spec, encoding, block_size=block_size, minus=theta, sparsity=sparsity, version=version
    )
    return blob, apply_update(theta, blob, spec)
