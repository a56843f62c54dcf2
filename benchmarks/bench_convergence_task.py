"""The convergence benchmark's task: the model, the data, the schedule and the arms' config.

The demo's transformer (its ``tiny`` shape, vocabulary 64) on the demo's Markov language;
``train`` is the inner loop every benchmark's learners share (AdamW, or the optimizer given,
under ``lr_at``'s schedule: linear warm-up, cosine decay to a tenth); ``run_config`` is the
gradientmail arms' ``RunConfig`` (``SPARSE`` names the ``topk`` arms); ``synthetic_learning``
is what a learner process of this task trains (``_workers.Learning``).
"""

import math
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from _workers import Learning

NAME = "convergence"
K = 4
FRAGMENTS = 4
BATCH = 16
CONTEXT = 32
LR = 3e-3
WARMUP_FRACTION = 0.05
EVAL_BATCHES = 4
EVAL_BATCH_SIZE = 64
FINAL_EVAL_BATCHES = 16
TARGETS: tuple[dict[str, Any], ...] = (
    {"arm": "gm-int8-H50", "excess_ratio_max": 1.10, "bytes_ratio_min": 150.0},
    {"arm": "gm-int4-H100", "excess_ratio_max": 1.20, "bytes_ratio_min": 400.0},
)


def plan(quick: bool) -> dict[str, Any]:
    """Steps, seeds and the gradientmail matrix.

    The full run repeats the reference arms and the two headline settings over three seeds
    and runs the rest of the matrix (every encoding at every H) on the first seed: the whole
    matrix over three seeds is 27 runs of five processes, which does not fit the 20-minute
    budget on two cores. The quick variant: one short seed, int8 at H=12 only.
    """
    if quick:
        return {
            "steps": 40,
            "seeds": [0],
            "sync_every": [12],
            "encodings": ["int8"],
            "repeated": [],
            "eval_every": 20,
        }
    return {
        "steps": 300,
        "seeds": [0, 1, 2],
        "sync_every": [25, 50, 100],
        "encodings": ["fp32", "int8", "int4"],
        "repeated": [target["arm"] for target in TARGETS],
        "eval_every": 50,
    }


def model_config() -> Any:
    from gradientmail.demo.model import GPTConfig

    return GPTConfig.tiny(vocab_size=64, context=CONTEXT)


def evaluation_sets(corpus: Any) -> tuple[list[Any], list[Any]]:
    """``corpus``'s held-out batches: those evaluated during training and the final set."""
    evaluation = corpus.evaluation(batches=EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=CONTEXT)
    final_set = corpus.evaluation(
        batches=FINAL_EVAL_BATCHES, batch_size=EVAL_BATCH_SIZE, length=CONTEXT
    )
    return evaluation, final_set


def lr_at(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to LR / 10."""
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: Any,
    batches: Iterator[Any],
    *,
    steps: int,
    eval_every: int,
    evaluation: list[Any],
    after_step: Callable[[], None] = lambda: None,
    first: int = 0,
    lr: float = LR,
    optimizer: Any = None,
) -> list[list[float]]:
    """Steps ``first .. steps - 1`` on ``batches`` at peak learning rate ``lr`` (``lr_at``'s
    schedule over ``steps``) with ``optimizer`` (a new AdamW when None), calling
    ``after_step`` after each; the evaluation loss every ``eval_every`` steps, as
    ``[step, loss]`` pairs (step ``first`` first)."""
    import torch

    from gradientmail.demo.data import evaluate

    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve = [[float(first), evaluate(model, evaluation)]]
    for step in range(first, steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps) * lr / LR
        loss = model.loss(next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        after_step()
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            curve.append([float(step + 1), evaluate(model, evaluation)])
    return curve


def mean_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """The learners' curves averaged point by point, as long as the shortest."""
    length = min(len(c) for c in curves)
    return [[curves[0][i][0], sum(c[i][1] for c in curves) / len(curves)] for i in range(length)]


_PLAIN: dict[str, Any] = {"outer_momentum": 0.0}
SPARSE: dict[str, dict[str, Any]] = {
    "topk1": {"topk_density": 0.01, **_PLAIN},
    "topk3": {"topk_density": 0.03, **_PLAIN},
    "topk1lr05": {"topk_density": 0.01, **_PLAIN, "outer_lr": 0.5},
    "topk3lr05": {"topk_density": 0.03, **_PLAIN, "outer_lr": 0.5},
    "topk1lr2": {"topk_density": 0.01, **_PLAIN, "outer_lr": 2.0},
    "topk3lr2": {"topk_density": 0.03, **_PLAIN, "outer_lr": 2.0},
    "topk1nag": {"topk_density": 0.01, "update_encoding": "int8"},
    "topk3nag": {"topk_density": 0.03, "update_encoding": "int8"},
}
"""The ``topk`` arms: their name as an encoding, and what they change of ``run_config``.
``topk1`` / ``topk3``: deltas at 1% / 3% density, 2 bits, chunks of 4096, updates ``topk``,
plain averaging at outer lr 1 (no momentum: the error feedback in its place, as SparseLoCo;
each element averaged over the deltas that sent it; the best outer lr measured,
docs/protocol.md), a checkpoint every 16 versions (the default for ``topk`` updates; without
momentum a checkpoint is θ alone, in fp32, against updates of a few kB: docs/protocol.md,
"Garbage collection"); ``…lrX``
the same at outer lr X; ``…nag`` the same deltas under the default Nesterov step, whose
dense update travels as int8."""


def run_config(sync_every: int, encoding: str) -> Any:
    """The arms' config: ``encoding`` for deltas and updates, or a ``SPARSE`` arm's."""
    from gradientmail.protocol.records import RunConfig

    sparse = SPARSE.get(encoding)
    config = RunConfig(
        fragments=FRAGMENTS,
        sync_every=sync_every,
        delta_encoding="topk" if sparse else encoding,  # type: ignore[arg-type]
        update_encoding="topk" if sparse else encoding,  # type: ignore[arg-type]
        grace=3.0,
    )
    return msgspec.structs.replace(config, **sparse) if sparse else config


def synthetic_learning(spec: dict[str, Any], index: int) -> Learning:
    """What learner ``index`` of the run ``spec`` describes trains: shard ``index`` of the
    Markov language of ``spec["seed"]``, for ``spec["steps"]`` steps."""
    import torch

    from gradientmail.demo.data import evaluate, synthetic
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    seed, steps = spec["seed"], spec["steps"]
    corpus = synthetic(length=CONTEXT, seed=seed)
    evaluation, final_set = evaluation_sets(corpus)
    model = GPT(model_config(), seed=seed)
    batches = corpus.train(index, batch_size=BATCH, length=CONTEXT)

    def run(first: int, after_step: Callable[[], None]) -> list[list[float]]:
        return train(
            model,
            batches,
            steps=steps,
            eval_every=spec["eval_every"],
            evaluation=evaluation,
            after_step=after_step,
            first=first,
        )

    return Learning(model, BATCH * CONTEXT, run, lambda: evaluate(model, final_set))
