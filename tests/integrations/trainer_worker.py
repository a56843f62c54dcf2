"""One learner as a framework's Trainer with gradientmail's callback, in its own process.

    python trainer_worker.py FRAMEWORK DIRECTORY LEARNER SEED OUT_DIR

FRAMEWORK is ``transformers`` or ``lightning``. Builds a tiny GPT-2 from a config (two
layers, no download), a tiny text data set made here, joins the run in DIRECTORY through the
framework's ``GradientmailCallback``, waits at a barrier until both learners joined, trains
``STEPS`` optimizer steps of two accumulated batches each, and writes
``OUT_DIR/LEARNER.json`` (the node's final state) and ``OUT_DIR/LEARNER.safetensors`` (the
final weights).
"""

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import safetensors.torch
import torch
from node_helpers import FAST
from transformers import GPT2Config, GPT2LMHeadModel

from gradientmail.mailbox import LocalMailbox
from gradientmail.patterns import Barrier
from gradientmail.protocol.records import RunConfig

STEPS = 12
ACCUMULATE = 2
BATCH = 4
CONTEXT = 16
CONFIG = RunConfig(fragments=2, sync_every=4, grace=0.5, keep_versions=1000, keep_rounds=1000)
TEXT = "the quick brown fox jumps over the lazy dog while gradients travel by mail. "


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=CONTEXT, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


class Characters(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Windows of ``TEXT`` as character codes, shifted by ``seed`` per learner."""

    def __init__(self, seed: int) -> None:
        codes = torch.tensor([ord(c) for c in TEXT * 8])
        starts = range(seed, len(codes) - CONTEXT, 3)
        self.rows = [codes[s : s + CONTEXT] for s in starts]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def wait_for_both(directory: str, learner: str) -> None:
    async def wait() -> None:
        barrier = Barrier(LocalMailbox(directory), learner, poll_interval=0.02)
        await barrier.wait("start", parties=2, timeout=120)

    anyio.run(wait)


def with_transformers(directory: str, learner: str, seed: int, out: Path) -> Any:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradientmail.integrations.transformers import GradientmailCallback

    class Rendezvous(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            wait_for_both(directory, learner)

    model = tiny_gpt2()
    callback = GradientmailCallback(directory, learner=learner, config=CONFIG, options=FAST)
    args = TrainingArguments(
        output_dir=str(out / f"hf-{learner}"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-3,
        include_num_input_tokens_seen=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Characters(seed),
        callbacks=[callback, Rendezvous()],
    )
    trainer.train()
    return model, callback.node


def with_lightning(directory: str, learner: str, seed: int, out: Path) -> Any:
    import lightning.pytorch as pl

    from gradientmail.integrations.lightning import GradientmailCallback

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Rendezvous(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, *args: Any) -> None:
            wait_for_both(directory, learner)

    module = Module()
    callback = GradientmailCallback(directory, learner=learner, config=CONFIG, options=FAST)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, Rendezvous()],
        default_root_dir=str(out / f"pl-{learner}"),
    )
    torch.manual_seed(seed)
    data = torch.utils.data.DataLoader(Characters(seed), batch_size=BATCH, shuffle=True)
    trainer.fit(module, data)
    return module, callback.node


def main(framework: str, directory: str, learner: str, seed: int, out: Path) -> None:
    torch.set_num_threads(1)
    run = {"transformers": with_transformers, "lightning": with_lightning}[framework]
    model, node = run(directory, learner, seed, out)
    state = node.state
    report = {"steps": state.steps, "tokens": state.tokens, "versions": list(state.versions)}
    (out / f"{learner}.json").write_text(json.dumps(report))
    weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    safetensors.torch.save_file(weights, str(out / f"{learner}.safetensors"))


if __name__ == "__main__":
    os.environ["HF_HUB_OFFLINE"] = "1"
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
