"""``group=`` refuses what is not an initialized gloo process group, before touching the
store; a node without a group reports itself as rank 0 of 1."""

import pytest
from node_helpers import FAST, tiny_model

import gradientmail
from gradientmail.mailbox import MemoryMailbox


@pytest.mark.anyio
async def test_a_group_needs_torch_distributed_initialized() -> None:
    mailbox = MemoryMailbox()
    with pytest.raises(ValueError, match=r"needs torch.distributed initialized"):
        async with gradientmail.node(
            tiny_model(), mailbox, learner="a", options=FAST, group=object()
        ):
            pass
    assert await mailbox.list("") == [], "a refused node touched the store"


@pytest.mark.anyio
async def test_a_node_without_a_group_is_rank_0_of_1() -> None:
    async with gradientmail.node(tiny_model(), MemoryMailbox(), learner="a", options=FAST) as node:
        await node.step(tokens=4)
        state = node.state
    assert (state.rank, state.world, state.group_bytes_sent, state.group_bytes_received) == (
        0,
        1,
        0,
        0,
    )
