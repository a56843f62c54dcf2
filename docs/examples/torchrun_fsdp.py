"""One learner of several processes whose model FSDP2 shards: torchrun starts the ranks,
``fully_shard`` cuts every parameter into one shard per rank, and gradientmail makes the
group one learner of the run in DIRECTORY, each rank moving the bytes of its own shard.

    torchrun --nproc_per_node 2 docs/examples/torchrun_fsdp.py [DIRECTORY] [LEARNER] [STEPS]

Start it again with another LEARNER (with any number of processes, sharded or not, or a
plain single-process learner) on the same DIRECTORY or bucket URL to train together. On
GPUs, initialize the default group with "nccl" and build the mesh on "cuda" for FSDP2, and
keep the gloo group below for gradientmail's exchanges (a few CPU ints per step).
"""

import math
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradientmail
import gradientmail.sync
from gradientmail import NodeOptions

CONFIG = gradientmail.RunConfig(fragments=3, sync_every=24, grace=0.5)
OPTIONS = NodeOptions(poll_interval=0.05, lease_every=0.5, lease_timeout=5.0, group_timeout=60.0)
BATCH = 32  # per rank: the learner's batch is BATCH × world size


def spirals(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (count,), generator=generator)
    radius = torch.rand(count, generator=generator) * 3 * math.pi
    angle = radius + label * math.pi
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1) / (3 * math.pi)
    return points + 0.02 * torch.randn(count, 2, generator=generator), label


def main(directory: str, learner: str, steps: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))  # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")  # gradientmail's group: CPU, gloo
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)
    )
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # "cuda" on GPUs
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Each rank its own data: a learner's ranks split its batch, as under plain FSDP2.
    points, labels = spirals(4096, seed=sum(map(ord, learner)) * 100 + rank)
    with gradientmail.sync.node(
        model, directory, learner=learner, config=CONFIG, options=OPTIONS, group=control
    ) as node:
        for step in range(steps):
            batch = slice(step * BATCH % 4096, step * BATCH % 4096 + BATCH)
            loss = nn.functional.cross_entropy(model(points[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            node.step(tokens=BATCH * world)  # every rank, every step: the learner's tokens
    state = node.state  # the same round, versions and steps on every rank
    print(
        f"{learner} rank {rank}/{state.world}: done: {state.steps} steps, round {state.round}, "
        f"store bytes up {state.bytes_published} down {state.bytes_downloaded}, group bytes "
        f"sent {state.group_bytes_sent} received {state.group_bytes_received}",
        flush=True,
    )
    # No rank tears the groups down while another still uses them (as PyTorch's own
    # distributed tests end: a barrier, then destroy_process_group).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(
        arguments[0] if arguments else "./gradientmail-torchrun",
        arguments[1] if len(arguments) > 1 else "site-1",
        int(arguments[2]) if len(arguments) > 2 else 200,
    )
