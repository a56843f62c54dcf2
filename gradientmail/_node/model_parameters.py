"""The model a node trains, as the named parameters the run splits into fragments, and for a
sharded learner (FSDP2) the rows of each parameter this rank holds."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from gradientmail.protocol.records import Manifest, ParamSpec

__all__ = ["LocalShard", "by_fragment", "named_parameters", "shards"]

T = TypeVar("T")


def by_fragment(manifest: Manifest, pick: Callable[[ParamSpec], T]) -> tuple[tuple[T, ...], ...]:
    """``pick``'s value of each parameter of each fragment of ``manifest``, in its
    ``spec.params`` order (the live parameters, a sharded rank's rows of them, ...)."""
    return tuple(tuple(pick(p) for p in spec.params) for spec in manifest.fragments)


def named_parameters(
    model: torch.nn.Module | None, *, sharded: bool = False
) -> list[tuple[str, Tensor]] | None:
    """``model``'s named parameters (None for no model). A ``DistributedDataParallel``
    wrapper is looked through, so a learner group's names are those of a single-process
    learner's model; with ``sharded``, a sharded (``DTensor``) parameter stands for the
    whole parameter (its global shape; ``shards`` gives this rank's rows). Raises
    ``TypeError``/``ValueError`` for what is not a model on one device with parameters, and
    ``TypeError`` for sharded parameters unless ``sharded``."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    named: list[tuple[str, Tensor]] = list(model.named_parameters())
    if not named:
        raise ValueError("model has no parameters to train together")
    found = [name for name, p in named if _is_dtensor(p)]
    if found and not sharded:
        raise TypeError(
            f"parameter {found[0]!r} is a sharded DTensor (FSDP2): pass group= (a gloo "
            "process group of the ranks it is sharded over, every rank entering the node); "
            "see docs/node.md, 'Learner groups'"
        )
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(
            f"model's parameters live on {len(devices)} devices ({sorted(map(str, devices))}); "
            "a node trains a model that lives on one device"
        )
    return named


@dataclass(frozen=True, slots=True)
class LocalShard:
    """This rank's part of one parameter: ``local``, the rows ``[start, end)`` of its first
    dimension (a 0-dimensional parameter is one row), as a tensor written in place."""

    local: Tensor
    start: int
    end: int


def shards(named: Sequence[tuple[str, Tensor]], rank: int, world: int) -> list[LocalShard] | None:
    """Each parameter's ``LocalShard`` on this rank when the parameters are sharded (``DTensor``,
    FSDP2's ``fully_shard``), None when none is. Every sharded parameter must be cut as
    ``fully_shard`` cuts it: ``Shard(0)`` on a one-dimensional mesh of the group's ``world``
    ranks, ``ceil(rows / world)`` rows per rank in rank order. Raises ``TypeError`` naming
    the first parameter that is sharded otherwise, or that is not sharded when others are."""
    sharded = [_is_dtensor(param) for _, param in named]
    if not any(sharded):
        return None
    found = []
    for (name, param), is_sharded in zip(named, sharded, strict=True):
        if not is_sharded:
            raise TypeError(
                f"parameter {name!r} is a plain tensor while others are sharded DTensors: "
                "shard every parameter (fully_shard the whole model) or none"
            )
        found.append(_shard(name, param, rank, world))
    return found


def _is_dtensor(param: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _shard(name: str, param: Tensor, rank: int, world: int) -> LocalShard:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as Placement

    assert isinstance(param, DTensor)
    placements = param.placements
    if param.device_mesh.ndim != 1 or placements != (Placement(0),):
        raise TypeError(
            f"parameter {name!r} is sharded as {placements} on a {param.device_mesh.ndim}-D "
            "mesh; a sharded learner needs Shard(0) on a one-dimensional mesh (fully_shard "
            "on init_device_mesh(device, (world,)))"
        )
    if param.device_mesh.size() != world:
        raise TypeError(
            f"parameter {name!r} is sharded over {param.device_mesh.size()} ranks, the group "
            f"has {world}: shard over the group's ranks"
        )
    rows = param.shape[0] if param.dim() else 1
    size = -(-rows // world)
    start = min(rank * size, rows)
    end = min(start + size, rows)
    local = param.to_local()
    if (local.shape[0] if local.dim() else 1) != end - start:
        raise TypeError(
            f"parameter {name!r}: this rank holds {tuple(local.shape)}, not rows "
            f"[{start}, {end}) of {tuple(param.shape)} as fully_shard cuts them"
        )
    return LocalShard(local, start, end)
