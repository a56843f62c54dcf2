"""One rank of a Hugging Face Trainer under torchrun (DDP, gloo, CPU) whose processes form
one learner through ``GradientmailCallback``.

    torchrun --nproc_per_node 2 hf_ddp_worker.py DIRECTORY LEARNER OUT_DIR

Trains the tiny GPT-2 of ``tests/integrations/trainer_worker.py`` for its ``STEPS`` and
writes ``OUT_DIR/LEARNER.RANK.json`` (the node's final state) and
``OUT_DIR/LEARNER.RANK.safetensors`` (the final weights).
"""

import json
import os
import sys
from pathlib import Path

import safetensors.torch
from node_helpers import FAST
from trainer_worker import BATCH, CONFIG, STEPS, Characters, tiny_gpt2
from transformers import Trainer, TrainingArguments

from gradientmail.integrations.transformers import GradientmailCallback


def main(directory: str, learner: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    model = tiny_gpt2()
    callback = GradientmailCallback(directory, learner=learner, config=CONFIG, options=FAST)
    args = TrainingArguments(
        output_dir=str(out / f"hf-{learner}"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        include_num_input_tokens_seen=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=Characters(0), callbacks=[callback]).train()
    node = callback.node
    assert node is not None
    state = node.state  # as the node stood when it closed
    name = f"{learner}.{rank}"
    report = {
        "steps": state.steps,
        "tokens": state.tokens,
        "versions": list(state.versions),
        "round": state.round,
        "world": state.world,
        "store_requests": sum(state.requests.values()),
    }
    (out / f"{name}.json").write_text(json.dumps(report))
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    safetensors.torch.save_file(weights, str(out / f"{name}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
