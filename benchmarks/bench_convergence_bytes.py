"""Bytes over a long run of the convergence task (``bench_convergence.py --long STEPS``).

int8 at H = 50 (``LONG_ARM``) for ``STEPS`` steps on seed 0, once per ``checkpoint_every``:
long enough that the closing flush is a small share of a learner's bytes (reported).
Written to ``convergence-bytes.json``.
"""

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_convergence_task as task
from bench_convergence_arms import run_gradientmail

LONG_ARM = ("int8", 50)
"""The headline setting whose bytes ``--long`` measures (≥ 75× with the syncer's share at
int8, H = 50, K = 4)."""


def _figures(report: dict[str, Any], dp_bytes: float) -> dict[str, Any]:
    """One run's bytes, per kind, its closing flush's and the syncer's, against
    data-parallel's ``dp_bytes`` per learner."""
    syncer = report["syncer"]
    closing = sum(r["bytes_closing"] for r in report["learners"]) / task.K
    return {
        "final_loss": report["final_loss"],
        "rounds_committed": report["rounds_committed"],
        "wall_seconds": report["wall_seconds"],
        "bytes_per_learner": report["bytes_per_learner"],
        "bytes_by_kind_per_learner": report["bytes_by_kind_per_learner"],
        "closing_bytes_per_learner": closing,
        "syncer_by_kind": syncer["bytes_by_kind"],
        "syncer_requests": syncer["requests"],
        "syncer_up": syncer["bytes_up"],
        "syncer_down": syncer["bytes_down"],
        "ratio_per_learner": dp_bytes / report["bytes_per_learner"],
        "ratio_with_syncer_share": dp_bytes
        / (report["bytes_per_learner"] + report["syncer_bytes"] / task.K),
    }


def long_bytes(
    results: Path, steps: int, every: list[int], log: Callable[[str], None] = print
) -> Path:
    """``LONG_ARM`` for ``steps`` steps on seed 0, once per ``checkpoint_every`` in ``every``:
    data-parallel's bytes ÷ a learner's, alone and with the syncer's traffic shared among the
    ``K`` learners, and how much of a learner's bytes its closing flush took; writes
    ``results/convergence-bytes.json``. Data-parallel's bytes are computed (ring all-reduce of
    fp32 gradients), not trained."""
    from gradientmail.demo.model import GPT
    from gradientmail.protocol.records import RunConfig

    params = GPT(task.model_config()).num_parameters()
    dp_bytes = 2 * (task.K - 1) / task.K * 4 * params * steps
    settings = task.plan(False) | {"steps": steps, "eval_every": steps}
    encoding, sync_every = LONG_ARM
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gm-bench-bytes-") as scratch:
        for n in every:
            report = run_gradientmail(
                0, sync_every, encoding, settings, Path(scratch) / f"every{n}",
                {"checkpoint_every": n},
            )  # fmt: skip
            runs[str(n)] = _figures(report, dp_bytes)
            log(
                f"  checkpoint_every {n}: {runs[str(n)]['ratio_per_learner']:.0f}x per learner, "
                f"{runs[str(n)]['ratio_with_syncer_share']:.0f}x with the syncer's share, "
                f"{report['rounds_committed']} rounds, {report['wall_seconds']:.0f} s"
            )
    parameters = {
        "steps": steps, "encoding": encoding, "sync_every": sync_every, "learners": task.K,
        "fragments": task.FRAGMENTS, "params": params, "checkpoint_every": every, "seed": 0,
        "default_checkpoint_every": RunConfig().checkpoint_interval,
    }  # fmt: skip
    result = h.header(f"{task.NAME}-bytes", quick=False, parameters=parameters)
    result["figures"] = {"dp_bytes_per_learner": dp_bytes, "runs": runs}
    return h.write_result(results, f"{task.NAME}-bytes", result)
