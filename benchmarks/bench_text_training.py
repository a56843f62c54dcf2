"""The real-text model's training: a learner's work in a worker process, the local arms here.

``learning`` is what learner ``k`` of a distributed arm trains (shard ``k`` of the corpus,
``bench_convergence_task.train``'s schedule, its final model saved for
``bench_text_eval.mean_model``); ``run_local`` trains the ``dp`` and ``single`` arms in this
process.
"""

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_convergence_task as convergence
import bench_text_data as data
import bench_text_eval
import bench_text_task as task
from _workers import Learning


def learning(spec: dict[str, Any], index: int) -> Learning:
    """Learner ``index``'s model, inner optimizer (``spec["inner"]``, AdamW when absent),
    batches (shard ``index`` of ``spec["learners"]``) and evaluation (``spec`` as
    ``bench_text_arms.worker_spec`` writes it); a restarted learner (its progress file
    exists) draws stream 1."""
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    size = task.SIZES[spec["size"]]
    corpus = data.stdlib_corpus(shards=spec["learners"], seed=spec["seed"])
    length = size["model"]["context"]
    evaluation = corpus.evaluation(*size["eval"], length=length)
    final_set = corpus.evaluation(*size["final_eval"], length=length)
    model = GPT(task.model_config(size), seed=spec["seed"])
    optimizer, lr = task.inner_optimizer(spec.get("inner", "adamw"), model)
    progress_path = Path(spec["scratch"]) / f"progress-{index}"
    stream = 1 if progress_path.exists() else 0
    batches = corpus.train(index, batch_size=size["batch"], length=length, stream=stream)

    def run(first: int, after_step: Callable[[], None]) -> list[list[float]]:
        return convergence.train(
            model,
            batches,
            steps=size["steps"],
            eval_every=size["eval_every"],
            evaluation=evaluation,
            after_step=after_step,
            first=first,
            lr=lr,
            optimizer=optimizer,
        )

    def final() -> float:
        bench_text_eval.save(model, Path(spec["scratch"]), index)
        return evaluate(model, final_set)

    return Learning(model, size["batch"] * length, run, final, optimizer)


def run_local(arm: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The ``dp`` or ``single`` arm, in this process on one thread: ``spec["learners"]``
    (``K`` when absent) shards, trained with ``spec["inner"]`` (AdamW when absent)."""
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    load = os.getloadavg()
    size = task.SIZES[spec["size"]]
    shards = spec.get("learners", task.K)
    corpus = data.stdlib_corpus(shards=shards, seed=spec["seed"])
    length = size["model"]["context"]
    learners = shards if arm == "dp" else 1
    streams = [corpus.train(k, batch_size=size["batch"], length=length) for k in range(learners)]

    def union() -> Any:
        while True:
            yield torch.cat([next(stream) for stream in streams])

    model = GPT(task.model_config(size), seed=spec["seed"])
    optimizer, lr = task.inner_optimizer(spec.get("inner", "adamw"), model)
    started = time.perf_counter()
    curve = convergence.train(
        model,
        union(),
        steps=size["steps"],
        eval_every=size["eval_every"],
        evaluation=corpus.evaluation(*size["eval"], length=length),
        lr=lr,
        optimizer=optimizer,
    )
    seconds = time.perf_counter() - started
    final = evaluate(model, corpus.evaluation(*size["final_eval"], length=length))
    params = model.num_parameters()
    result: dict[str, Any] = {
        "final_loss": final,
        "bits_per_byte": task.bits(final),
        "curve": [*curve, [float(size["steps"]), final]],
        "wall_seconds": seconds,
        "train_seconds": seconds,
        "params": params,
        "load": {"start": list(load), "end": list(os.getloadavg())},
    }
    if arm == "dp":
        result["bytes_per_learner"] = 2 * (shards - 1) / shards * 4 * params * size["steps"]
    return result
