"""Error feedback for ``topk`` deltas: what a learner's delta did not send stays with the
learner and is added to its next delta of the same fragment.

For a snapshot ``S`` of a fragment taken from the base ``B``, with the fragment's residual
``e`` (zeros at first), the learner encodes ``x = (S − B) + e`` (fp32, element by element) as
``topk`` (``encoded``) and keeps ``e' = x − decode(blob)``: exactly what was not sent, bit
for bit (``x̂ + e' = x``; ``protocol.sparse`` sends an element only where that holds).

``e'`` becomes the fragment's residual only when the round *includes* the snapshot
(``Feedback.resolved``): a late snapshot's steps stay in the learner's weights (the merge
keeps ``θ_local − B``) and go out with its next delta, and a rejected one's are dropped, so in
both cases the residual stays ``e``, and nothing is counted twice or lost by the merge.

The residuals live with the learner only, in its driver (``_node.learner_driver``): they are not
in the store, and a learner that restarts or joins starts from zeros. What it loses is what
its deltas had not yet sent (each element below its chunk's selection), the same kind of loss
as the local steps a restart drops.

Pure: ``Feedback`` is an immutable value whose tensors are never modified once in it;
``encoded`` runs on whatever thread calls it (a worker thread in the node) and returns fresh
tensors. Memory: the residual (one fp32 copy of the fragment) and the blob.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from gradientmail.protocol.codec import encode_fragment, open_fragment
from gradientmail.protocol.merge import Outcome
from gradientmail.protocol.pieces import chunk_ranges
from gradientmail.protocol.records import FragmentSpec
from gradientmail.protocol.sparse import TOPK, SparseBlob, Sparsity

__all__ = ["Feedback", "encoded"]


def encoded(
    snapshot: Sequence[Tensor],
    base: Sequence[Tensor],
    residual: Sequence[Tensor] | None,
    spec: FragmentSpec,
    sparsity: Sparsity,
) -> tuple[bytes, SparseBlob, tuple[Tensor, ...]]:
    """``(blob, opened, e')``: the ``topk`` blob of ``x = (snapshot − base) + residual``
    (``residual`` None: zeros), the blob opened, and ``e' = x − decode(blob)``, fresh fp32
    CPU tensors. Raises ``ValueError`` for tensors that do not match ``spec``."""
    x = []
    for i, (s, b) in enumerate(zip(snapshot, base, strict=True)):
        flat = s.detach().to("cpu", torch.float32).reshape(-1) - b.detach().to(
            "cpu", torch.float32
        ).reshape(-1)
        if residual is not None:
            flat.add_(residual[i].reshape(-1))
        x.append(flat.view(s.shape))
    blob = encode_fragment(x, spec, TOPK, block_size=sparsity.chunk, sparsity=sparsity)
    opened = open_fragment(blob, spec)
    assert isinstance(opened, SparseBlob)
    for index, tensor in enumerate(x):
        flat = tensor.view(-1)
        for start, end in chunk_ranges(flat.numel()):
            flat[start:end].sub_(opened.piece(index, start, end))
    return blob, opened, tuple(x)


@dataclass(frozen=True, slots=True)
class Feedback:
    """The residual of each fragment (``residuals``; absent: zeros) and the residual of the
    snapshot of each fragment still waiting for its round (``pending``: fragment ->
    ``(round, e')``)."""

    residuals: Mapping[int, tuple[Tensor, ...]] = field(default_factory=dict)
    pending: Mapping[int, tuple[int, tuple[Tensor, ...]]] = field(default_factory=dict)

    def residual(self, fragment: int) -> tuple[Tensor, ...] | None:
        """The residual the next delta of ``fragment`` adds (None: zeros)."""
        return self.residuals.get(fragment)

    def taken(self, fragment: int, round: int, residual: tuple[Tensor, ...]) -> "Feedback":
        """The snapshot of ``fragment`` for ``round`` was encoded, leaving ``residual``."""
        return replace(self, pending={**self.pending, fragment: (round, residual)})

    def resolved(self, fragment: int, round: int, outcome: Outcome) -> "Feedback":
        """``round`` of ``fragment`` was committed with the learner's snapshot ``outcome``:
        an included snapshot's residual becomes the fragment's; a pending snapshot of that
        round or an earlier one is otherwise forgotten (the residual stays)."""
        found = self.pending.get(fragment)
        if found is None or found[0] > round:
            return self
        pending = {f: p for f, p in self.pending.items() if f != fragment}
        residuals = dict(self.residuals)
        if outcome == "included" and found[0] == round:
            residuals[fragment] = found[1]
        return Feedback(residuals, pending)
