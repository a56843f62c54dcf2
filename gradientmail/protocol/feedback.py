"""Error feedback for ``topk`` deltas: what a learner's delta did not send stays in the
learner's weights, decayed, and goes out with its next delta of the same fragment.

For a snapshot ``S`` of a fragment taken from the base ``B`` the learner encodes
``x = S − B`` (fp32, element by element) as ``topk`` (``encoded``); ``e = x − decode(blob)``
is exactly what was not sent, bit for bit (``x̂ + e = x``; ``protocol.sparse`` sends an
element only where that holds), and the learner keeps ``β·e``, ``β`` being
``RunConfig.topk_feedback`` (the decay of SparseLoCo's error-feedback accumulator).

When the round *includes* the snapshot, the merge adds ``β·e`` back to the learner's weights
(``merge.merge_into``'s ``kept``): ``θ_local ← θ_{v+1} + (θ_local − S) + β·e``, so the next
delta, taken from ``θ_{v+1}``, holds ``β·e`` with the steps since, and ``(1 − β)·e`` is
dropped: an unsent change that was not among the largest for a while fades instead of
keeping the learners' weights apart (at ``β`` 1 nothing fades). A late snapshot's steps
stay in the weights whole (the merge keeps ``θ_local − B``), and ``e`` is forgotten; a
rejected one's are dropped with whatever the weights held unsent. Nothing is counted twice:
a learner's weights always equal the committed θ plus what it has not yet sent and kept. A
closing learner's final snapshot, dense (``sparse.sent_as``) and taken from the model
closing began with, sends all those weights held beyond θ, and its round leaves the learner
on θ (``merge``'s ``final``).

Held this way, the residual costs no memory beyond the pending ``β·e`` of each snapshot
waiting for its round, and it lives nowhere but the learner's weights: a learner that
restarts or joins starts from the committed θ, losing what its deltas had not yet sent (the
same kind of loss as the local steps a restart drops).

Pure: ``Feedback`` is an immutable value whose tensors are never modified once in it;
``encoded`` runs on whatever thread calls it (a worker thread in the node) and returns fresh
tensors. Memory: ``e`` (one fp32 copy of the fragment) and the blob.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradientmail.protocol.codec import encode_fragment, open_fragment
from gradientmail.protocol.merge import Merge
from gradientmail.protocol.pieces import chunk_ranges
from gradientmail.protocol.records import FragmentSpec
from gradientmail.protocol.sparse import TOPK, SparseBlob, Sparsity

__all__ = ["Feedback", "encoded"]


def encoded(
    snapshot: Sequence[Tensor],
    base: Sequence[Tensor],
    spec: FragmentSpec,
    sparsity: Sparsity,
    *,
    keep: float = 1.0,
    version: int = 0,
) -> tuple[bytes, SparseBlob, tuple[Tensor, ...]]:
    """``(blob, opened, kept)``: the ``topk`` blob of ``x = snapshot − base`` (a blob of
    ``version``, ``framing.Meta``), the blob opened, and ``kept = keep·e`` with
    ``e = x − decode(blob)``, fresh fp32 CPU tensors (at ``keep`` 1, ``e`` itself).
    Raises ``ValueError`` for tensors that do not match ``spec``."""
    x = [
        s.detach()
        .to("cpu", torch.float32)
        .reshape(-1)
        .sub(b.detach().to("cpu", torch.float32).reshape(-1))
        .view(s.shape)
        for s, b in zip(snapshot, base, strict=True)
    ]
    blob = encode_fragment(
        x, spec, TOPK, block_size=sparsity.chunk, sparsity=sparsity, version=version
    )
    opened = open_fragment(blob, spec)
    assert isinstance(opened, SparseBlob)
    for index, tensor in enumerate(x):
        flat = tensor.view(-1)
        for start, end in chunk_ranges(flat.numel()):
            flat[start:end].sub_(opened.piece(index, start, end))
        if keep != 1.0:
            flat.mul_(keep)
    return blob, opened, tuple(x)


@dataclass(frozen=True, slots=True)
class Feedback:
    """The unsent residual of each fragment's snapshot still waiting for its round
    (``pending``: fragment -> ``(round, e)``)."""

    pending: Mapping[int, tuple[int, tuple[Tensor, ...]]] = field(default_factory=dict)

    def taken(self, fragment: int, round: int, residual: tuple[Tensor, ...]) -> "Feedback":
        """The snapshot of ``fragment`` for ``round`` was encoded, leaving ``residual``."""
        return Feedback({**self.pending, fragment: (round, residual)})

    def resolved(
        self, fragment: int, round: int, outcome: Merge
    ) -> tuple["Feedback", tuple[Tensor, ...] | None]:
        """``round`` of ``fragment`` was committed with the learner's snapshot ``outcome``:
        the feedback without the pending residual of that round or an earlier one, and the
        residual the merge adds back to the weights (an included snapshot of that very round;
        otherwise None)."""
        found = self.pending.get(fragment)
        if found is None or found[0] > round:
            return self, None
        left = Feedback({f: p for f, p in self.pending.items() if f != fragment})
        return left, found[1] if outcome == "included" and found[0] == round else None
