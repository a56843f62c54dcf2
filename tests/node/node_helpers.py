"""Helpers for the node's tests: a tiny model, its training step, and what runs check."""

from collections.abc import Awaitable, Callable, Sequence

import anyio
import torch
from run_checks import Recorder as Recorder
from run_checks import assert_steps_accounted as assert_steps_accounted
from run_checks import commits_by_round as commits_by_round
from torch import nn

from gradientmail._node import Node, NodeOptions
from gradientmail.mailbox import Mailbox, MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.codec import encode_fragment
from gradientmail.protocol.fragments import window
from gradientmail.protocol.records import Manifest, RoundRecord, RunConfig, Snapshot, decode
from gradientmail.reader import RunReader
from gradientmail.store import Store

torch.set_num_threads(1)

FAST = NodeOptions(
    poll_interval=0.02,
    lease_every=0.1,
    lease_timeout=1.0,
    claim_timeout=2.0,
    creation_timeout=1.0,
    close_timeout=10.0,
    max_retry_delay=0.2,
)
LEARNER_ONLY = NodeOptions(
    poll_interval=FAST.poll_interval,
    lease_every=FAST.lease_every,
    lease_timeout=FAST.lease_timeout,
    close_timeout=FAST.close_timeout,
    syncer=False,
)
CONFIG = RunConfig(fragments=2, sync_every=4, grace=0.3, keep_versions=1000, keep_rounds=1000)


def tiny_model(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class SharedView(MemoryMailbox):
    """One node's view of a shared ``MemoryMailbox``: the same objects, so that a subclass
    can count one node's requests."""

    def __init__(self, shared: MemoryMailbox) -> None:
        super().__init__()
        self._objects, self._lock = shared._objects, shared._lock


class Trainer:
    """Plain SGD on a fixed synthetic regression task, one batch per step. (Written out
    rather than ``torch.optim.SGD``, whose import costs seconds in every worker process.)"""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model = model
        generator = torch.Generator().manual_seed(seed)
        device = next(model.parameters()).device
        self.x = torch.randn(256, 8, generator=generator).to(device)
        self.y = self.x.sum(dim=1, keepdim=True).sin()
        self.at = 0

    def step(self) -> float:
        batch = slice(self.at % 256, self.at % 256 + 16)
        self.at += 16
        self.model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x[batch]), self.y[batch])
        loss.backward()
        with torch.no_grad():
            for param in self.model.parameters():
                if param.grad is not None:
                    param.sub_(param.grad, alpha=0.05)
        return float(loss.detach())


async def train(
    node: Node,
    model: nn.Module,
    seed: int,
    until_round: int,
    limit: float = 60.0,
    compute: float = 0.001,
) -> None:
    """Train until the node has seen ``until_round``'s record (or ``limit`` seconds pass),
    each step followed by ``compute`` seconds of simulated compute (the default, a
    millisecond, keeps three learners in step with the syncers' polling on a loaded
    machine)."""
    trainer = Trainer(model, seed)
    with anyio.fail_after(limit):
        while node.state.round < until_round:
            await anyio.to_thread.run_sync(trainer.step)
            await node.step(tokens=16)
            await anyio.sleep(compute)


async def wait_until(condition: Callable[[], Awaitable[bool]], limit: float = 30.0) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail after ``limit`` seconds."""
    with anyio.fail_after(limit):
        while True:
            if await condition():
                return
            await anyio.sleep(0.01)


async def created_manifest(box: Mailbox) -> Manifest:
    """The run's manifest, once its creator has written it."""

    async def created() -> bool:
        return await box.get(keys.MANIFEST) is not None

    await wait_until(created)
    return decode(await box.get(keys.MANIFEST) or b"", Manifest)


async def forged_snapshot(
    box: Mailbox, manifest: Manifest, round: int, learner: str, fill: float = 1e6
) -> Snapshot:
    """A well-formed snapshot of ``learner`` for ``round`` of a two-fragment run, one step,
    whose delta (in the store) is ``fill`` everywhere: with the default, one that would
    wreck θ if it were taken. Unsigned: its writer signs it if the test needs it."""
    spec = manifest.fragments[round % 2]
    delta = [torch.full(p.shape, fill) for p in spec.params]
    ref = await Store(box).put_blob(encode_fragment(delta, spec, "fp32", block_size=1), "fp32")
    return Snapshot(
        learner=learner,
        round=round,
        fragment=round % 2,
        base_version=round // 2,
        steps=1,
        tokens=1,
        delta=ref,
        norm=None,
    )


async def records(mailbox: Mailbox) -> list[RoundRecord]:
    """Every committed round record, in order; asserts they are contiguous from 0."""
    store = Store(mailbox)
    rounds = await store.record_rounds()
    assert rounds == list(range(len(rounds))), f"records are not contiguous: {rounds}"
    found = []
    for round in rounds:
        record = await store.record(round)
        assert record is not None
        found.append(record)
    return found


async def committed_theta(mailbox: Mailbox, fragment: int, version: int) -> list[torch.Tensor]:
    """θ of ``version`` of ``fragment``: rebuilt from the checkpoint at or below it."""
    rebuilt = await RunReader.of(mailbox, unverified=True).rebuild(fragment, version)
    assert rebuilt is not None, f"version {version} of fragment {fragment} cannot be rebuilt"
    return list(rebuilt.theta)


async def assert_holds_committed(
    mailbox: Mailbox, model: nn.Module, versions: Sequence[int]
) -> None:
    """``model``'s weights are, fragment by fragment, the committed θ of ``versions``."""
    data = await mailbox.get(keys.MANIFEST)
    assert data is not None
    manifest = decode(data, Manifest)
    params = dict(model.named_parameters())
    for fragment, version in enumerate(versions):
        theta = await committed_theta(mailbox, fragment, version)
        for spec, value in zip(manifest.fragments[fragment].params, theta, strict=True):
            assert torch.equal(window(params[spec.name], spec).detach(), value), (
                f"{spec.name} (fragment {fragment}) differs from version {version}"
            )
