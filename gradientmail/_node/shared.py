"""The shared model: the run's newest committed version of every fragment, as a user
evaluates and saves it (end of an epoch, end of the run), rather than one learner's local
weights, which drift from it between rounds."""

import torch
from torch import Tensor, nn

from gradientmail.protocol.records import Manifest
from gradientmail.reader import RunReader, check_model
from gradientmail.store import Store

__all__ = ["shared_model"]


async def shared_model(
    store: Store, manifest: Manifest, into: nn.Module | None = None
) -> dict[str, Tensor]:
    """Every parameter of the run's newest committed versions by name (CPU tensors in the
    model's dtypes), read from ``store`` through ``RunReader``; copied into ``into``'s
    parameters in place too when given. Raises ``RunMismatch`` when ``into`` is not the
    run's model (left untouched then), ``CorruptBlob``/``RecordError`` for damaged
    objects. Buffers are not part of a run: copy them from the training model."""
    if into is not None:
        named = list(into.named_parameters())
        check_model(manifest, named)
    state = (await RunReader(store).newest(manifest)).state_dict(manifest)
    if into is not None:
        by_name = dict(named)
        with torch.no_grad():
            for name, value in state.items():
                by_name[name].copy_(value)
    return state
