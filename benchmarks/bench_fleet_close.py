"""The close of a ``bench_fleet`` run, measured: the newest committed θ each learner reads
when its budget ends (``committed_reading``, in its process, before its close), the one of
those no final round had reached (``before_final``: the model the close starts from), and
the run's newest committed model once every learner closed (``shared_loss``, in the
runner's process): the shared model the close must not make worse."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_text_data as data
import bench_text_task as task


def committed_reading(
    spec: dict[str, Any], index: int, model: Any, loss: Callable[[Any], float]
) -> None:
    """The newest committed θ when learner ``index``'s budget ended (before its close): its
    validation loss and newest round, in ``committed-{index}`` (the close is judged against
    it: a final round must not make the shared model worse)."""
    import copy

    import gradientmail.sync

    committed = copy.deepcopy(model)
    sources = gradientmail.sync.load(str(Path(spec["scratch"]) / "store"), committed)
    newest = max((s.round for s in sources if s.round is not None), default=-1)
    figures = {"loss": loss(committed), "round": newest}
    (Path(spec["scratch"]) / f"committed-{index}").write_text(json.dumps(figures))


def shared_loss(scratch: Path, size_name: str, seed: int, learners: int) -> float:
    """The validation loss of the run's newest committed model once every learner closed:
    the shared model (a learner whose final snapshot was left out ends on an older θ, so the
    learners' own models after their close may differ from it)."""
    import torch

    import gradientmail.sync
    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    size = task.SIZES[size_name]
    corpus = data.stdlib_corpus(shards=learners, seed=seed)
    model = GPT(task.model_config(size), seed=seed)
    gradientmail.sync.load(str(scratch / "store"), model)
    length = size["model"]["context"]
    return evaluate(model, corpus.evaluation(*size["final_eval"], length=length))


def before_final(scratch: Path, learners: int, rounds: list[dict[str, Any]]) -> float | None:
    """The validation loss of the newest committed θ that a learner read at its budget's end
    and that no closing snapshot had reached yet (None when every reading came after a final
    round): the model the close started from."""
    first_final = min((r["round"] for r in rounds if r.get("closing")), default=None)
    readings = [json.loads((scratch / f"committed-{k}").read_text()) for k in range(learners)]
    clean = [r for r in readings if first_final is None or r["round"] < first_final]
    return max(clean, key=lambda r: r["round"])["loss"] if clean else None
