"""The real-text benchmark's one final evaluation: the mean of the learners' models.

Every distributed arm, whatever the system, ends the same way: each learner process saves
its model's parameters when it is done (``save``: gradientmail after its closing round,
torchft after its last fragment sync), and the runner averages the ``K`` saved models
element by element and evaluates that one model on the held-out windows
(``mean_model``). For gradientmail after its closing round the learners hold the same
model, so the mean is that model; torchft's learners still hold up to ``H − H / F`` steps of
un-averaged local progress in the fragments not synced last, and the mean averages it,
as data-parallel's reference would. The spread (the largest difference of one element
between two learners) says how far apart the learners ended.
"""

from pathlib import Path
from typing import Any


def model_path(scratch: Path, index: int) -> Path:
    """Where learner ``index`` of the run in ``scratch`` saves its final model."""
    return scratch / f"final-model-{index}.pt"


def save(model: Any, scratch: Path, index: int) -> None:
    """Save ``model``'s state (learner ``index``) for ``mean_model``; the learner's thread."""
    import torch

    torch.save(model.state_dict(), model_path(scratch, index))


def mean_model(scratch: Path, learners: int, size: dict[str, Any], seed: int) -> dict[str, Any]:
    """The final figure of a distributed arm: the validation loss (nats per byte) of the mean
    of the ``learners`` models saved in ``scratch``, on the size's final windows of the
    corpus of ``seed``, and the learners' spread. ``FileNotFoundError`` naming the file when
    a learner saved none."""
    import bench_text_data as data
    import bench_text_task as task
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    states = [torch.load(model_path(scratch, k), weights_only=True) for k in range(learners)]
    mean = {
        name: torch.stack([state[name].double() for state in states]).mean(0).to(tensor.dtype)
        for name, tensor in states[0].items()
    }
    spread = 0.0
    for name, first in states[0].items():
        if first.is_floating_point():
            stacked = torch.stack([state[name] for state in states])
            spread = max(spread, float((stacked.amax(0) - stacked.amin(0)).max()))
    model = GPT(task.model_config(size), seed=seed)
    model.load_state_dict(mean)
    length = size["model"]["context"]
    corpus = data.stdlib_corpus(shards=learners, seed=seed)
    loss = evaluate(model, corpus.evaluation(*size["final_eval"], length=length))
    return {"final_loss": loss, "learner_spread": spread}
