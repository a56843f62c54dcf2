"""What a learner's polls for round records cost: while a round is due, a read of the next
round's record; a listing of ``records/`` (which grows by one key a round) only at its idle
pace, at least ``poll_interval`` apart."""

import time
from collections.abc import Sequence

import pytest
from node_helpers import FAST, tiny_model, train

from gradientmail._node import NodeOptions
from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import RunConfig

pytestmark = pytest.mark.anyio

IDLE = 0.5


class Counted(MemoryMailbox):
    """Counts the listings of ``records/`` and the reads of record keys."""

    def __init__(self) -> None:
        super().__init__()
        self.listings = 0
        self.reads = 0

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self.listings += prefix == keys.RECORDS
        return await super().list(prefix, after=after)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self.reads += key.startswith(keys.RECORDS)
        return await super().get(key, max_bytes=max_bytes)


async def test_a_learner_waiting_on_its_rounds_reads_the_next_record_instead_of_listing() -> None:
    box = Counted()
    config = RunConfig(fragments=2, sync_every=4, grace=0.3, overlap=0)
    options = NodeOptions(
        poll_interval=IDLE,
        due_poll_interval=0.01,
        wait_poll_interval=0.005,
        lease_every=FAST.lease_every,
        lease_timeout=FAST.lease_timeout,
        close_timeout=FAST.close_timeout,
    )
    model = tiny_model()
    began = time.monotonic()
    async with open_node(model, box, learner="a", config=config, options=options) as node:
        await train(node, model, seed=0, until_round=16)
        elapsed = time.monotonic() - began
        listings, reads = box.listings, box.reads
    # Every round's step waited for its record (the synchronous mode), polling at the wait
    # pace: each such poll a read, the listings at most one an idle pause (and the syncer's
    # one on recovering).
    assert reads >= 16, reads
    assert listings <= elapsed / IDLE + 3, (listings, elapsed)
