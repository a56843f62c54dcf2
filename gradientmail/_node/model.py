"""The model a node trains, as the named parameters the run splits into fragments."""

import torch
from torch import Tensor

__all__ = ["named_parameters"]


def named_parameters(model: torch.nn.Module | None) -> list[tuple[str, Tensor]] | None:
    """``model``'s named parameters (None for no model). A ``DistributedDataParallel``
    wrapper is looked through, so a learner group's names are those of a single-process
    learner's model. Raises ``TypeError``/``ValueError`` for what is not a model on one
    device with parameters, and for sharded (``DTensor``, FSDP2) parameters, which a
    learner does not support yet."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    named: list[tuple[str, Tensor]] = list(model.named_parameters())
    if not named:
        raise ValueError("model has no parameters to train together")
    sharded = [name for name, p in named if _sharded(p)]
    if sharded:
        raise TypeError(
            f"parameter {sharded[0]!r} is a sharded DTensor (FSDP2): learner groups support "
            "replicated parameters (DDP) only; see docs/node.md, 'Learner groups'"
        )
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(
            f"model's parameters live on {len(devices)} devices ({sorted(map(str, devices))}); "
            "a node trains a model that lives on one device"
        )
    return named


def _sharded(param: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)
