"""A model on a CUDA device: snapshots go through pinned memory and non-blocking copies, and
the weights still end exactly at the committed θ. Skipped where no GPU is present."""

import anyio
import pytest
import torch
from node_helpers import (
    CONFIG,
    FAST,
    Recorder,
    assert_holds_committed,
    assert_steps_accounted,
    records,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.mailbox import MemoryMailbox

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_two_nodes_on_a_gpu_end_at_the_committed_weights() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    finals = {}

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed).cuda()
        async with open_node(
            model, box, learner=name, config=CONFIG, options=FAST, sinks=[sink]
        ) as node:
            await train(node, model, seed=seed, until_round=8)
        finals[name] = (model, node.state)

    async with anyio.create_task_group() as tg:
        tg.start_soon(member, "g1", 0)
        tg.start_soon(member, "g2", 1)

    history = await records(box)
    for name, (model, state) in finals.items():
        cpu = tiny_model()
        cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        await assert_holds_committed(box, cpu, state.versions)
        assert_steps_accounted(name, state.steps, state.tokens, sink.events, history)
