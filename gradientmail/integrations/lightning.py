"""``GradientmailCallback``: a Lightning ``Trainer`` as one learner of a run.

    trainer = lightning.Trainer(callbacks=[GradientmailCallback(url, learner="host-3")])

``on_train_start`` joins the run with the ``LightningModule`` (its weights become the
run's newest), ``on_train_batch_end`` counts one step each time the Trainer's optimizer
stepped (``trainer.global_step`` moved: with ``accumulate_grad_batches`` the tokens of the
accumulated batches go into that step), ``on_train_end`` closes with flush and
``on_exception`` closes without flush. Tokens per batch come from ``tokens_of(batch)``
(default: the element count of the batch's tensor, of its first element for a tuple or
list, of ``batch["input_ids"]`` for a mapping). The Trainer must run one process
(``RuntimeError`` otherwise; see ``docs/integrations.md``). Needs
``pip install 'gradientmail[lightning]'``.
"""

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import torch

from gradientmail import sync
from gradientmail._node import NodeOptions
from gradientmail.events import Sink
from gradientmail.integrations._member import Member, missing_extra, refuse_processes
from gradientmail.protocol.records import RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.sync import Node

try:
    from lightning.pytorch import Callback
except ImportError as exc:
    raise missing_extra("lightning", "lightning") from exc

__all__ = ["GradientmailCallback", "count_tokens"]


def count_tokens(batch: Any) -> int:
    """The default ``tokens_of``: see the module docstring. Raises ``TypeError`` naming
    ``tokens_of`` for a batch of another shape."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return int(batch["input_ids"].numel())
    if isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].numel())
    if isinstance(batch, torch.Tensor):
        return int(batch.numel())
    raise TypeError(
        f"cannot count the tokens of a {type(batch).__name__} batch: pass "
        "GradientmailCallback(..., tokens_of=lambda batch: ...)"
    )


class GradientmailCallback(Callback):  # type: ignore[misc]
    """Join ``mailbox`` (a URL or directory) as ``learner`` for the Trainer's fit; the other
    arguments are ``gradientmail.sync.node``'s. ``node`` is the open node (None outside
    training). Hooks run on the Trainer's thread; ``NodeFailed`` raises from
    ``on_train_batch_end`` and ``on_train_end`` when the node failed."""

    def __init__(
        self,
        mailbox: str,
        *,
        learner: str,
        config: RunConfig | None = None,
        options: NodeOptions | None = None,
        sinks: Sequence[Sink] = (),
        run_key: RunKey | str | bytes | None = None,
        backend: Literal["asyncio", "trio"] = "asyncio",
        handle_signals: bool = False,
        tokens_of: Callable[[Any], int] = count_tokens,
    ) -> None:
        self._member = Member(
            partial(
                sync.node,
                mailbox=mailbox,
                learner=learner,
                config=config,
                options=options,
                sinks=sinks,
                run_key=run_key,
                backend=backend,
                handle_signals=handle_signals,
            )
        )
        self._tokens_of = tokens_of
        self._tokens = 0
        self._global_step = 0

    @property
    def node(self) -> Node | None:
        return self._member.node

    def on_train_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        refuse_processes(trainer.world_size, "the Lightning Trainer")
        self._member.join(pl_module)
        self._tokens = 0
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: torch.nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tokens += self._tokens_of(batch)
        if trainer.global_step == self._global_step:
            return
        self._global_step = trainer.global_step
        tokens, self._tokens = self._tokens, 0
        self._member.step(tokens)

    def on_train_end(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        self._member.close()

    def on_exception(
        self, trainer: Any, pl_module: torch.nn.Module, exception: BaseException
    ) -> None:
        self._member.abandon(exception)
