"""The convergence benchmark's arms, one run each: ``dp`` and ``single`` in this process,
a gradientmail arm as ``K`` learner processes and a dedicated syncer process (``_launch``
running ``bench_convergence.py --worker``)."""

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_convergence_task as task
import msgspec
from _launch import launch

WORKER_SCRIPT = Path(__file__).resolve().with_name("bench_convergence.py")
"""The file the worker processes run (``--worker SPEC ROLE``)."""


def _union(streams: list[Iterator[Any]]) -> Iterator[Any]:
    import torch

    while True:
        yield torch.cat([next(stream) for stream in streams])


def run_local(arm: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The ``dp`` or ``single`` arm, in this process on one thread."""
    import torch

    from gradientmail.demo.data import evaluate, synthetic
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    corpus = synthetic(length=task.CONTEXT, seed=seed)
    evaluation, final_set = task.evaluation_sets(corpus)
    model = GPT(task.model_config(), seed=seed)
    learners = task.K if arm == "dp" else 1
    streams = [corpus.train(k, batch_size=task.BATCH, length=task.CONTEXT) for k in range(learners)]
    started = time.perf_counter()
    curve = task.train(
        model,
        _union(streams),
        steps=settings["steps"],
        eval_every=settings["eval_every"],
        evaluation=evaluation,
    )
    seconds = time.perf_counter() - started
    final = evaluate(model, final_set)
    params = model.num_parameters()
    assert corpus.floor is not None
    result: dict[str, Any] = {
        "final_loss": final,
        "excess": final - corpus.floor,
        "floor": corpus.floor,
        "curve": [*curve, [float(settings["steps"]), final]],
        "tokens_per_step": learners * task.BATCH * task.CONTEXT,
        "seconds": seconds,
        "params": params,
    }
    if arm == "dp":
        k = task.K
        result["bytes_per_learner_computed"] = 2 * (k - 1) / k * 4 * params * settings["steps"]
    return result


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_gradientmail(
    seed: int,
    sync_every: int,
    encoding: str,
    settings: dict[str, Any],
    scratch: Path,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One gradientmail run: ``K`` learner processes and one syncer process; gathers their
    reports into the arm's figures. ``overrides`` replace fields of ``run_config``'s."""
    config = msgspec.structs.replace(task.run_config(sync_every, encoding), **(overrides or {}))
    spec = {
        "seed": seed,
        "steps": settings["steps"],
        "eval_every": settings["eval_every"],
        "learners": task.K,
        "config": msgspec.structs.asdict(config),
        "scratch": str(scratch),
    }
    launched = launch(WORKER_SCRIPT, spec)
    return _figures(launched, seed)


def _figures(launched: dict[str, Any], seed: int) -> dict[str, Any]:
    """A gradientmail arm's figures from its processes' reports (``launch``'s answer)."""
    from gradientmail.demo.data import synthetic

    n = task.K
    reports = [launched["reports"][str(i)] for i in range(n)]
    syncer_report = launched["reports"]["syncer"]
    floor = synthetic(length=task.CONTEXT, seed=seed).floor
    assert floor is not None
    finals = [r["final_loss"] for r in reports]
    final = sum(finals) / n
    per_learner = [r["bytes_up"] + r["bytes_down"] for r in reports]
    rounds = syncer_report["rounds"]
    return {
        "final_loss": final,
        "final_loss_spread_over_learners": max(finals) - min(finals),
        "excess": final - floor,
        "floor": floor,
        "curve": task.mean_curve([r["curve"] for r in reports]),
        "tokens_per_step": n * task.BATCH * task.CONTEXT,
        "bytes_per_learner": sum(per_learner) / n,
        "bytes_up_per_learner": sum(r["bytes_up"] for r in reports) / n,
        "bytes_down_per_learner": sum(r["bytes_down"] for r in reports) / n,
        "bytes_by_kind_per_learner": {
            kind: sum(r["bytes_by_kind"].get(kind, 0) for r in reports) / n
            for kind in sorted({kind for r in reports for kind in r["bytes_by_kind"]})
        },
        "syncer_bytes": syncer_report["bytes_up"] + syncer_report["bytes_down"],
        "rounds_committed": len(rounds),
        "mean_participants": sum(r["participants"] for r in rounds) / len(rounds)
        if rounds
        else 0.0,
        "rejected": sum(len(r["rejected"]) for r in rounds),
        "peak_store_bytes": launched["peak_store_bytes"],
        "mean_delta_bytes": _mean([size for r in reports for size in r["delta_bytes"]]),
        "mean_update_bytes": _mean([r["update_bytes"] for r in rounds]),
        "wall_seconds": launched["wall_seconds"],
        "train_seconds": sum(r["train_seconds"] for r in reports) / n,
        "learners": reports,
        "syncer": {k: v for k, v in syncer_report.items() if k != "rounds"} | {"rounds": rounds},
    }
