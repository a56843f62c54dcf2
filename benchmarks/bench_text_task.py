"""The real-text benchmark's task: its sizes, arms, model, inner optimizers and config.

What every part of ``bench_text.py`` shares (the runner, its modes, the worker processes,
``bench_fleet``): ``SIZES`` (steps, model, batch, the matrix of H and encodings, the kill,
the evaluation windows, the pacing), ``arms`` (every arm of a size, in the order they run),
``model_config``, ``run_config`` (the gradientmail arms' ``RunConfig``), ``inner_optimizer``
(AdamW or clipped plain SGD), and ``invocation`` (what tells the invocations that measured
runs apart).
"""

import math
from typing import Any

import bench_convergence_task as convergence
import msgspec

NAME = "text"
"""The full size's result is ``text.json``; another size's ``text-{size}.json``."""
K = 4
FRAGMENTS = 5
"""Five, so that every H of the matrix (50, 100, 250) is a multiple of it: torchft's
DiLoCo syncs one fragment every ``H / F`` steps and refuses an H that F does not divide."""
HARNESS = {"torchft_init_sync": False, "evaluation": "mean of the learners' models"}
"""What a results file records of how the two systems were set against each other: a file
without it was measured with torchft's ``init_sync`` on and each system's loss taken at its
own point (the report judges no comparison from it)."""
SYNCER_IN = 0
"""The learner whose process runs the gradientmail arms' one syncer node beside its own
(``_workers.learner_worker``): no interpreter of its own to start beside the learners, as
torchft's arms start none beside theirs. A results file whose ``parameters`` lack
``syncer_in`` ran the syncer as a process of its own."""
KILLED = 1
KILL_AT = 0.4
LR = 2e-3

SIZES: dict[str, dict[str, Any]] = {
    "quick": {
        "learners": 2,
        "steps": 40,
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 32},
        "batch": 4,
        "sync_every": [10],
        "encodings": ["fp32"],
        "torchft": [10],
        "kill_sync_every": 10,
        "restart_after": 2.0,
        "eval": (4, 16),
        "final_eval": (8, 16),
        "eval_every": 20,
    },
    "small": {
        "steps": 200,
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "context": 64},
        "batch": 8,
        "sync_every": [10, 20, 50],
        "encodings": ["fp32", "int8", "int4", "topk1", "topk3"],
        "torchft": [10, 20, 50],
        "kill_sync_every": 20,
        "restart_after": 20.0,
        "eval": (4, 32),
        "final_eval": (16, 32),
        "eval_every": 50,
    },
    "medium": {
        "steps": 1000,
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "context": 64},
        "batch": 8,
        "sync_every": [50, 100, 250],
        "encodings": ["fp32", "int8", "int4", "topk1", "topk3"],
        "torchft": [50, 100, 250],
        "kill_sync_every": 100,
        "restart_after": 20.0,
        "eval": (4, 32),
        "final_eval": (16, 32),
        "eval_every": 200,
    },
    "full": {
        "steps": 1000,
        "model": {"d_model": 128, "n_layers": 5, "n_heads": 4, "context": 128},
        "batch": 16,
        "sync_every": [50, 100, 250],
        "encodings": ["fp32", "int8", "int4", "topk1", "topk3"],
        "torchft": [50, 100, 250],
        "kill_sync_every": 100,
        "restart_after": 20.0,
        "eval": (4, 32),
        "final_eval": (32, 32),
        "eval_every": 200,
        "pacing": {
            "poll_interval": 0.5,
            "due_poll_interval": 0.05,
            "lease_every": 2.0,
            "lease_timeout": 10.0,
        },
    },
}


def learners(size_name: str) -> int:
    """The learners of the size's distributed arms: ``K``, or two at the quick size (smoke-test
    sizes: every path of a run, with fewer processes)."""
    return int(SIZES[size_name].get("learners", K))


def arms(size: dict[str, Any]) -> list[str]:
    """Every arm of ``size``, in the order they run: each torchft arm right after the
    gradientmail arm it is compared with, so that a machine whose speed drifts over the
    hour-and-a-half of a full run skews a ratio as little as it can."""
    names = ["dp", "single"]
    for s in size["sync_every"] if "fp32" in size["encodings"] else []:
        names.append(f"gm-fp32-H{s}")
        if s in size["torchft"]:
            names.append(f"torchft-fp32-H{s}")
    names += [f"torchft-fp32-H{s}" for s in size["torchft"] if s not in size["sync_every"]]
    names += [f"gm-{e}-H{s}" for e in size["encodings"] if e != "fp32" for s in size["sync_every"]]
    kill = size["kill_sync_every"]
    names += [f"gm-fp32-H{kill}-kill", f"torchft-fp32-H{kill}-kill"]
    return names


def model_config(size: dict[str, Any]) -> Any:
    from gradientmail.demo.model import GPTConfig

    return GPTConfig(vocab_size=256, **size["model"])


def run_config(sync_every: int, encoding: str, **changes: Any) -> Any:
    """The gradientmail arms' config: ``bench_convergence_task``'s (grace 3 s), ``F``
    fragments, with ``changes`` (``RunConfig`` fields, e.g. ``--overlap``'s)."""
    return msgspec.structs.replace(
        convergence.run_config(sync_every, encoding),
        fragments=FRAGMENTS,
        pattern="contiguous",
        **changes,
    )


def bits(nats: float) -> float:
    """``nats`` (per byte) in bits."""
    return nats / math.log(2)


SGD_LR = 3.0
SGD_CLIP = 0.25
"""The plain-SGD inner optimizer (``inner="sgd"``): peak learning rate and the gradient-norm
clip, as pytorch/examples' word language model trains (SGD, clipping 0.25). The rate is
this transformer's: the best of 0.3, 1, 3 and 10 for the single arm at size ``medium``
(3.70, 3.49, 3.37 and 3.92 bits per byte after 1,000 steps, seed 0; AdamW: 3.15)."""


def inner_optimizer(name: str, model: Any) -> tuple[Any, float]:
    """The inner optimizer ``name`` (``adamw`` or ``sgd``) over ``model``'s parameters and its
    peak learning rate (``bench_convergence_task.train`` schedules it)."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0), LR
    if name != "sgd":
        raise ValueError(f"unknown inner optimizer {name!r}: adamw or sgd")
    params = list(model.parameters())

    class ClippedSGD(torch.optim.SGD):
        """SGD that clips the gradients' global norm to ``SGD_CLIP`` before each step."""

        def step(self, closure: Any = None) -> Any:
            torch.nn.utils.clip_grad_norm_(params, SGD_CLIP)
            return super().step(closure)

    return ClippedSGD(params, lr=SGD_LR), SGD_LR


def invocation(result: dict[str, Any]) -> dict[str, Any]:
    """What tells the invocation that wrote ``result`` (a results file's header) apart from
    another: when, at which commit, with which ``RunConfig.overlap``, harness (``HARNESS``,
    None before it) and syncer (``SYNCER_IN``, None: a process of its own); a run's
    ``measured``."""
    return {
        "date": result["date"],
        "git_commit": result["git_commit"],
        "overlap": result["parameters"].get("overlap"),
        "harness": result["parameters"].get("harness"),
        "syncer_in": result["parameters"].get("syncer_in"),
    }
