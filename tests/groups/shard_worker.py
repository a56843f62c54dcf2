"""One rank of ``test_fsdp_shards.py``: a model cut by ``fully_shard`` on a CPU mesh of two ranks,
its rows read by ``_node.model_parameters.shards``; writes what it found to ``OUT/RANK.json``."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradientmail._node.model_parameters import named_parameters, shards


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    try:
        named_parameters(model)
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    named = named_parameters(model, sharded=True)
    assert named is not None
    found = shards(named, rank, world)
    assert found is not None
    rows = []
    for (name, param), shard in zip(named, found, strict=True):
        full = param.full_tensor()  # type: ignore[attr-defined]
        same = torch.equal(shard.local, full[shard.start : shard.end])
        with torch.no_grad():
            shard.local.add_(1.0)
        moved = torch.equal(param.to_local(), full[shard.start : shard.end] + 1.0)  # type: ignore[attr-defined]
        rows.append([name, list(param.shape), shard.start, shard.end, same, moved])
    # A file per rank: the ranks' prints to one pipe can interleave within a line.
    found_by = {"rank": rank, "refused": refused, "rows": rows}
    (Path(sys.argv[1]) / f"{rank}.json").write_text(json.dumps(found_by))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
