"""Two nodes train one small classifier together over a directory, under trio.

    python docs/examples/train_two_nodes.py [DIRECTORY] [STEPS]

Each node trains the same MLP on its own two-spirals data with AdamW (the inner optimizer);
gradientmail averages their progress fragment by fragment. The run is in the repeatable mode
(RunConfig.repeatable: the rounds pace the learners) and the two meet at a barrier before
their first step, so that a new run of the same steps computes the same model; under the
default schedule each node trains at its own pace and two runs end differently. Rerun on a
DIRECTORY to continue.
"""

import math
import sys
import tempfile

import anyio
import torch
from torch import nn

import gradientmail
from gradientmail import Barrier, NodeOptions, node

CONFIG = gradientmail.RunConfig.repeatable(fragments=3, sync_every=24, grace=0.5)
OPTIONS = NodeOptions(poll_interval=0.05, lease_every=0.5, lease_timeout=5.0)
BATCH = 64


def spirals(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (count,), generator=generator)
    radius = torch.rand(count, generator=generator) * 3 * math.pi
    angle = radius + label * math.pi
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1) / (3 * math.pi)
    return points + 0.02 * torch.randn(count, 2, generator=generator), label


def model() -> nn.Module:
    torch.manual_seed(0)  # the creator's weights become the run's Θ⁰; joiners load them
    return nn.Sequential(
        nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)
    )


async def learner(name: str, directory: str, seed: int, steps: int) -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    x, y = spirals(8192, seed)

    def train_step(step: int) -> float:
        batch = torch.randint(0, len(x), (BATCH,), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    async with (
        gradientmail.mailbox.open(directory) as mailbox,
        node(net, mailbox, learner=name, config=CONFIG, options=OPTIONS) as n,
    ):
        await Barrier(mailbox, name, poll_interval=0.05).wait("start", parties=2, timeout=60)
        for step in range(steps):
            loss = await anyio.to_thread.run_sync(train_step, step)
            await n.step(tokens=BATCH)
            if step % 100 == 0:
                print(f"{name}: step {step:4d}  loss {loss:.3f}  versions {n.state.versions}")
    test_x, test_y = spirals(2048, 99)
    with torch.no_grad():
        accuracy = float((net(test_x).argmax(dim=1) == test_y).float().mean())
    state = n.state
    print(
        f"{name}: done: {state.steps} steps, {state.rounds_committed} rounds committed, "
        f"{state.bytes_published} B up, {state.bytes_downloaded} B down, accuracy {accuracy:.2f}"
    )


async def main(directory: str, steps: int) -> None:
    print(f"run directory: {directory}")
    async with anyio.create_task_group() as tg:
        tg.start_soon(learner, "alice", directory, 1, steps)
        tg.start_soon(learner, "bob", directory, 2, steps)


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="gradientmail-")
    anyio.run(main, where, int(sys.argv[2]) if len(sys.argv) > 2 else 600, backend="trio")
