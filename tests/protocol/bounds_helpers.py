"""The fragment, config and candidates the aggregation bound tests share
(``test_protocol_bounds.py``, ``test_protocol_robust.py``)."""

import torch

from gradientmail.protocol.aggregation import Candidate
from gradientmail.protocol.records import BlobRef, FragmentSpec, ParamSpec, RunConfig, Snapshot

SPEC = FragmentSpec(
    index=1,
    params=(
        ParamSpec(name="a.weight", shape=(2, 3), dtype="float32"),
        ParamSpec(name="a.bias", shape=(3,), dtype="float32"),
    ),
)
CONFIG = RunConfig(fragments=2, sync_every=4, max_tokens_per_step=10_000, robust=True)
VERSION = 5
REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


def tensors(values: list[float]) -> list[torch.Tensor]:
    flat = torch.tensor(values, dtype=torch.float32)
    return [flat[:6].reshape(2, 3).clone(), flat[6:].clone()]


def candidate(learner: str, values: list[float], *, steps: int = 4, tokens: int = 40) -> Candidate:
    snapshot = Snapshot(
        learner=learner,
        round=VERSION * 2 + 1,
        fragment=1,
        base_version=VERSION,
        steps=steps,
        tokens=tokens,
        delta=REF,
        norm=None,
    )
    return Candidate(snapshot=snapshot, delta=tensors(values), problem=None)
