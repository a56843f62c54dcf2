"""Three nodes in one process train over S3 (a real moto server on 127.0.0.1); each opens
and closes its own S3 mailbox from a URL."""

from dataclasses import replace

import anyio
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    Recorder,
    assert_holds_committed,
    assert_steps_accounted,
    commits_by_round,
    records,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.events import GaveUp
from gradientmail.mailbox import open as open_mailbox

pytestmark = pytest.mark.anyio

# HTTP round trips to moto cost milliseconds each (tens on a loaded machine): poll and beat
# less often than in memory, or the three nodes' requests queue up behind each other. A
# closing node waits as long as a real one would: on a loaded machine a round's commit over
# moto can stall for longer than the in-memory tests' close timeout, and a node that gives up
# ends off the committed θ.
S3_OPTIONS = replace(
    FAST, poll_interval=0.1, lease_every=1.0, lease_timeout=5.0, close_timeout=60.0
)


async def test_three_nodes_train_over_s3(moto_server: str, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run?endpoint_url={moto_server}&region=us-east-1"
    sink = Recorder()
    finals = {}

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(
            model, url, learner=name, config=CONFIG, options=S3_OPTIONS, sinks=[sink]
        ) as node:
            await train(node, model, seed=seed, until_round=4, limit=150)
        finals[name] = (model, node.state)

    async with anyio.create_task_group() as tg:
        for seed, name in enumerate(("a", "b", "c")):
            tg.start_soon(member, name, seed)

    async with open_mailbox(url) as box:
        history = await records(box)
        assert len(history) >= 5
        assert commits_by_round(sink.events) == {r.round: 1 for r in history}
        assert [e for e in sink.events if isinstance(e, GaveUp)] == []
        for name, (model, state) in finals.items():
            await assert_holds_committed(box, model, state.versions)
            assert_steps_accounted(name, state.steps, state.tokens, sink.events, history)
            assert state.requests["put"] > 0
            assert state.bytes_published > 0
            assert state.bytes_downloaded > 0
