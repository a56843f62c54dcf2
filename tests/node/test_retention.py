"""Retention by default: what the store holds stays within the bound ``RunConfig`` states,
in ``preview``'s arithmetic and in a real run's directory."""

import os
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from node_helpers import FAST, LEARNER_ONLY, records, train, wait_until
from torch import nn

from gradientmail import preview
from gradientmail._node import node as open_node
from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import stateful
from gradientmail.protocol.fragments import Preview
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

LEARNERS = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Linear(256, 1))


def stored(directory: Path) -> dict[str, int]:
    """The size of every file under ``directory``, by path (one a collection deletes while
    this lists it left out)."""
    sizes = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            try:
                sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
            except FileNotFoundError:
                continue
    return sizes


def stated_peak(config: RunConfig, learners: int) -> float:
    """``RunConfig``'s bound on the store's peak over the model's fp32 size, for fragments of
    equal size: Θ⁰, each fragment's checkpoint, last ``C`` updates and the deltas of its
    last ``C − 1`` rounds, and while a round closes its new checkpoint and update and the
    deltas of it and of the ``F − 1`` rounds ahead; without momentum, checkpoints of θ
    alone and no delta kept for a replay."""
    shown = preview(model().named_parameters(), config, learners=learners)
    fp32 = sum(f.blob_bytes["fp32"] for f in shown.fragments)
    # A topk update holds the union of the learners' selections: at most K of them.
    u = (
        sum(
            learners * f.topk_update_bytes
            if config.update_encoding == "topk"
            else f.blob_bytes[config.update_encoding]
            for f in shown.fragments
        )
        / fp32
    )
    d = sum(f.blob_bytes[config.delta_encoding] for f in shown.fragments) / fp32
    every, count = config.checkpoint_interval, config.fragments
    if not stateful(config):
        return 2 + every * u + (1 + u + (count + 1) * learners * d) / count
    return 3 + every * u + every * learners * d + (2 + u) / count


REAL_TEXT = GPTConfig(vocab_size=256, d_model=128, n_layers=5, n_heads=4, context=128)
"""The byte GPT of the real-text benchmark's full size (``benchmarks/bench_text_task.py``)."""

SPARSE = RunConfig(delta_encoding="topk", update_encoding="topk", outer_momentum=0.0, outer_lr=2.0)
"""A ``topk`` run as docs/protocol.md recommends: no momentum, the error feedback instead."""


@pytest.mark.parametrize("encoding", ["fp32", "int8", "int4", "stateless-fp32", "topk"])
def test_the_default_retention_keeps_what_its_bound_states(encoding: str) -> None:
    """``preview``'s peak for the default retention at four learners is the bound
    ``RunConfig`` states (small objects aside), and for the default encoding under 14× the
    model's fp32 size; without momentum (fp32 or ``topk``) the smaller bound, and for
    ``topk`` under 3× on the real-text benchmark's full-size model."""
    if encoding == "topk":
        config = SPARSE
    elif encoding == "stateless-fp32":
        config = RunConfig(outer_momentum=0.0)
    else:
        config = RunConfig(delta_encoding=encoding, update_encoding=encoding)
    shown = preview(model().named_parameters(), config, learners=LEARNERS)
    fp32 = sum(f.blob_bytes["fp32"] for f in shown.fragments)
    least, most = shown.costs().storage
    if encoding == RunConfig().delta_encoding:
        assert most <= 14 * fp32, (least / fp32, most / fp32)
    if encoding == "topk":
        # This model's layers are too small for 1% of a chunk of 4096: the 3x is checked on
        # the real-text benchmark's full-size model (the run the docs' figure is about).
        real = preview(GPT(REAL_TEXT).named_parameters(), config, learners=LEARNERS)
        real_fp32 = sum(f.blob_bytes["fp32"] for f in real.fragments)
        assert real.costs().storage[1] <= 3 * real_fp32, real.costs().storage[1] / real_fp32
    bound = stated_peak(config, LEARNERS)
    assert bound <= most / fp32 <= 1.02 * bound, (most / fp32, bound)


class Peak:
    """The directory at its fullest: its size and what it held then."""

    def __init__(self) -> None:
        self.size = 0
        self.held: dict[str, int] = {}

    def saw(self, held: dict[str, int]) -> None:
        if (size := sum(held.values())) > self.size:
            self.size, self.held = size, held

    def _keys(self) -> list[str]:
        return [path.removeprefix("objects/").removesuffix("%") for path in self.held]

    def snapshots(self) -> dict[int, int]:
        """The snapshots held at the peak, counted by round."""
        rounds: dict[int, int] = {}
        for key in self._keys():
            if (parsed := keys.parse_snapshot(key)) is not None:
                rounds[parsed[0]] = rounds.get(parsed[0], 0) + 1
        return dict(sorted(rounds.items()))

    def beyond(self, config: RunConfig) -> int:
        """The rounds past the ``F − 1`` after the newest record that learners had
        published to at the peak: their waits for a slow closer ended (``rounds.due_for``)
        and they ran on, which the bound leaves out."""
        held = [r for key in self._keys() if (r := keys.parse_record(key)) is not None]
        newest = max(held, default=-1)
        ahead = max(self.snapshots(), default=newest) - newest
        return max(ahead - (config.fragments - 1), 0)

    def described(self, fp32: int) -> str:
        """What a failed bound shows: the peak over the model's fp32 size, the blobs' count,
        the snapshots by round and the records."""
        keys_held = self._keys()
        blobs = sum(key.startswith(keys.BLOBS) for key in keys_held)
        records = sum(keys.parse_record(key) is not None for key in keys_held)
        return (
            f"{self.size / fp32:.2f}x fp32: {blobs} blobs, snapshots by round "
            f"{self.snapshots()}, {records} records"
        )


def closing_finals(shown: Preview) -> int:
    """What a ``topk`` run's close adds beside the rounds' bound (docs/protocol.md, "What
    the store holds"): every learner's final snapshots and the final rounds' updates, dense
    (``Preview.closing_bytes``)."""
    up, down = shown.closing_bytes()
    return LEARNERS * up + down


class Sampled(LocalMailbox):
    """A node's view of a shared directory that notes the directory's size after each put
    (the store only grows at puts), the largest in ``peak``."""

    def __init__(self, directory: Path, peak: Peak) -> None:
        super().__init__(directory)
        self._peak = peak

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        written = await super().put_if_absent(key, data)
        self._peak.saw(stored(self.directory))
        return written


@pytest.mark.parametrize("sparse", [False, True], ids=["fp32", "topk"])
async def test_a_run_with_the_default_retention_stays_within_its_bound(
    tmp_path: Path, sparse: bool
) -> None:
    """Four learners, one of them also the syncer, with the default retention and encoding
    (or ``topk`` without momentum) through enough checkpoint cycles for collection to be
    steady: the directory at its fullest holds no more than ``preview``'s peak and the
    records, within the bound (``topk``: checkpoints of θ alone, under 3× with the
    records, and the dense finals of its close beside them), and the deltas of any round the
    learners ran on to past the bound's ``F − 1`` ahead (a loaded machine's closer fell
    behind their waits)."""
    changes = msgspec.structs.asdict(SPARSE) if sparse else {}
    config = RunConfig.repeatable(**{**changes, "sync_every": 8, "grace": 0.3, "overlap": 2})
    shown = preview(model().named_parameters(), config, learners=LEARNERS)
    fp32 = sum(f.blob_bytes["fp32"] for f in shown.fragments)
    run = shown.costs()
    peak = Peak()
    # Two checkpoint cycles under topk (its default cycle is long: TOPK_CHECKPOINT_EVERY
    # versions of each fragment), eight otherwise: the peak comes with a new checkpoint.
    until = (2 if sparse else 8) * config.fragments * config.checkpoint_interval

    async def learner(index: int) -> None:
        trained = model()
        options = FAST if index == 0 else LEARNER_ONLY
        box = Sampled(tmp_path, peak)
        async with open_node(
            trained, box, learner=f"learner-{index}", config=config, options=options
        ) as node:
            await train(node, trained, seed=index, until_round=until, limit=300.0)

    async def created() -> bool:
        return await LocalMailbox(tmp_path).get(keys.MANIFEST) is not None

    async with anyio.create_task_group() as tg:
        tg.start_soon(learner, 0)
        await wait_until(created)
        for index in range(1, LEARNERS):
            tg.start_soon(learner, index)
    rounds = len(await records(LocalMailbox(tmp_path)))
    assert rounds >= until
    # Besides the blobs, snapshots and claims: the records, and leases and markers.
    small = rounds * run.record_bytes + 16_384
    if sparse:
        # Its blobs weigh a few kB each, as much as the snapshots and claims the bound leaves
        # aside, of which a loaded machine keeps a few more in flight: the run is held to the
        # 3x its docs claim, and its close to the dense finals beside it.
        assert peak.size <= 3 * fp32 + small + closing_finals(shown), peak.described(fp32)
        return
    # Each round the learners ran past the bound's F − 1 ahead holds their deltas.
    delta = max(f.blob_bytes[config.delta_encoding] for f in shown.fragments)
    ran_on = peak.beyond(config) * LEARNERS * delta
    assert peak.size <= run.storage[1] + small + ran_on, peak.described(fp32)
    assert peak.size <= stated_peak(config, LEARNERS) * fp32 + small + ran_on, peak.described(fp32)
