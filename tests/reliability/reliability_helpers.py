"""What the reliability tests share: a tiny model and trainer, an event recorder, and the
checks a run must pass whatever happened to it (records contiguous, one commit per round,
every step accounted for, weights equal to what was committed)."""

import torch
from run_checks import Recorder as Recorder
from run_checks import assert_steps_accounted as assert_steps_accounted
from run_checks import commits_by_round as commits_by_round
from torch import nn

from gradientmail._node import NodeOptions
from gradientmail.mailbox import Mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import RoundRecord, RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import RunReader
from gradientmail.store import Store

torch.set_num_threads(1)

FAST = NodeOptions(
    poll_interval=0.02,
    lease_every=0.1,
    lease_timeout=1.0,
    claim_timeout=2.0,
    creation_timeout=1.0,
    close_timeout=20.0,
    max_retry_delay=0.05,
)
CONFIG = RunConfig(fragments=2, sync_every=4, grace=0.2, keep_rounds=8, keep_versions=4)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


class Trainer:
    """Plain SGD on a fixed synthetic regression task, one batch of 16 per step."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model = model
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(128, 6, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True).sin()
        self.at = 0

    def step(self) -> None:
        batch = slice(self.at % 128, self.at % 128 + 16)
        self.at += 16
        self.model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x[batch]), self.y[batch])
        loss.backward()
        with torch.no_grad():
            for param in self.model.parameters():
                if param.grad is not None:
                    param.sub_(param.grad, alpha=0.05)


async def history(mailbox: Mailbox, run_key: RunKey | None = None) -> list[RoundRecord]:
    """Every committed round record, in order (read as a node with ``run_key`` reads them,
    junk skipped); asserts they are contiguous from round 0 and that each names the fragment
    and version its round produces."""
    store = Store(mailbox, run_key=run_key, unverified=True)
    manifest = await store.manifest()
    assert manifest is not None
    rounds = await store.record_rounds()
    assert rounds == list(range(len(rounds))), f"records are not contiguous: {rounds}"
    found = []
    for round in rounds:
        record = await store.record(round)
        assert record is not None
        assert record.fragment == keys.fragment_of(round, manifest.config.fragments)
        assert record.version == keys.version_of(round, manifest.config.fragments)
        found.append(record)
    return found


async def newest_theta(mailbox: Mailbox, run_key: RunKey | None = None) -> dict[str, torch.Tensor]:
    """The newest committed θ of every parameter, by name."""
    store = Store(mailbox, run_key=run_key, unverified=True)
    manifest = await store.manifest()
    assert manifest is not None
    records = await history(mailbox, run_key)
    parts: dict[str, list[torch.Tensor]] = {}
    reader = RunReader(store)
    for fragment, spec in enumerate(manifest.fragments):
        version = max((r.version for r in records if r.fragment == fragment), default=0)
        rebuilt = await reader.rebuild(fragment, version, manifest=manifest)
        assert rebuilt is not None
        for param, value in zip(spec.params, rebuilt.theta, strict=True):
            parts.setdefault(param.name, []).append(value)
    # A parameter split by rows has its parts in fragment order, which is row order.
    return {name: torch.cat(values) for name, values in parts.items()}


def assert_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), weights[name]), f"{name} differs"
