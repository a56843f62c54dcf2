"""θ read by rows, as a rank of a sharded learner reads it: every θ and update blob a syncer
writes carries a chunk index, and ``RunReader.rebuild_rows`` gives, for any split of the rows,
the very bits of those rows of the whole rebuild, having read about its share of each blob."""

import msgspec
import pytest
import torch
from node_helpers import CONFIG, FAST, records, tiny_model, train

from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RunConfig
from gradientmail.reader import RunReader

pytestmark = pytest.mark.anyio

EVERY = msgspec.structs.replace(CONFIG, checkpoint_every=3, delta_encoding="int8")
TOPK = msgspec.structs.replace(
    EVERY, delta_encoding="topk", update_encoding="topk", topk_chunk=64, outer_momentum=0.0
)


def split(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, int]:
    rows = shape[0] if shape else 1
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@pytest.mark.parametrize("config", [EVERY, TOPK], ids=["int8", "topk"])
async def test_rows_of_every_version_are_the_rows_of_the_rebuild(config: RunConfig) -> None:
    """For ``topk`` updates too (read whole: their rows have no fixed place)."""
    mailbox = MemoryMailbox()
    model = tiny_model(hidden=64)
    async with open_node(model, mailbox, learner="a", config=config, options=FAST) as node:
        await train(node, model, seed=0, until_round=9)
    history = await records(mailbox)
    reader = RunReader.of(mailbox, unverified=True)
    manifest = await reader.manifest()
    for record in history:
        assert isinstance(record.update.index, str)
        assert (record.theta is None) or isinstance(record.theta.index, str)
    assert all(isinstance(ref.index, str) for ref in manifest.theta0)
    for fragment, spec in enumerate(manifest.fragments):
        top = max(r.version for r in history if r.fragment == fragment)
        for version in range(top + 1):
            whole = await reader.rebuild(fragment, version, manifest=manifest)
            assert whole is not None
            for world in (1, 2, 3):
                for rank in range(world):
                    rows = [split(p.shape, world, rank) for p in spec.params]
                    got = await reader.rebuild_rows(fragment, version, rows, manifest=manifest)
                    assert got is not None
                    for t, w, (start, end) in zip(got.theta, whole.theta, rows, strict=True):
                        want = w[start:end] if w.dim() else w
                        assert torch.equal(t.view(torch.int32), want.contiguous().view(torch.int32))
