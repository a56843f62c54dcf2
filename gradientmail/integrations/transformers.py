"""``GradientmailCallback``: a Hugging Face ``Trainer`` as one learner of a run.

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[GradientmailCallback(url, learner="host-3")])

``on_train_begin`` joins the run (the model's weights become the run's newest),
``on_step_end`` counts one optimizer step (the Trainer calls it once per optimizer step, so
gradient accumulation is respected) with the tokens it consumed, and ``on_train_end`` closes
with flush. Tokens come from ``state.num_input_tokens_seen``
(``TrainingArguments(include_num_input_tokens_seen=True)``), else from ``tokens_per_step``;
a run weighted by tokens refuses to start with neither. Under DDP (``torchrun``) the
Trainer's processes form one learner (a learner group over a new gloo group; the Trainer's
token count is already the sum over its processes); see ``docs/integrations.md``. Needs
``pip install 'gradientmail[transformers]'``.
"""

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

from gradientmail import sync
from gradientmail._node import NodeOptions
from gradientmail.events import Sink
from gradientmail.integrations._member import Member, learner_group, missing_extra
from gradientmail.protocol.records import RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.sync import Node

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise missing_extra("transformers", "transformers") from exc

__all__ = ["GradientmailCallback"]


class GradientmailCallback(TrainerCallback):  # type: ignore[misc]
    """Join ``mailbox`` (a URL or directory) as ``learner`` for the Trainer's training; the
    other arguments are ``gradientmail.sync.node``'s. ``node`` is the open node (None
    outside training). Hooks run on the Trainer's thread; ``NodeFailed`` raises from
    ``on_step_end`` and ``on_train_end`` when the node failed."""

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
        tokens_per_step: int | None = None,
    ) -> None:
        if tokens_per_step is not None and (
            isinstance(tokens_per_step, bool)
            or not isinstance(tokens_per_step, int)
            or tokens_per_step < 0
        ):
            raise ValueError(f"tokens_per_step must be a non-negative int, got {tokens_per_step!r}")
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
        self._tokens_per_step = tokens_per_step
        self._seen = 0

    @property
    def node(self) -> Node | None:
        return self._member.node

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        group = learner_group(args.world_size, "the Trainer")
        counting = args.include_num_input_tokens_seen not in (False, "no", None)
        node = self._member.join(kwargs["model"], group)
        if node.config.weighting == "tokens" and not counting and self._tokens_per_step is None:
            self._member.abandon(ValueError("no token count"))
            raise ValueError(
                "this run weighs snapshots by tokens, and the Trainer does not count them: "
                "set TrainingArguments(include_num_input_tokens_seen=True) or pass "
                "GradientmailCallback(..., tokens_per_step=N)"
            )
        self._seen = state.num_input_tokens_seen

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        seen = state.num_input_tokens_seen
        tokens = seen - self._seen if seen > self._seen else (self._tokens_per_step or 0)
        self._seen = seen
        self._member.step(int(tokens))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._member.close()
