"""The defaults grid of the convergence task (``bench_convergence.py --grid``).

One gradientmail run per point of outer lr × outer momentum × H × (quorum fraction, grace)
× fragment pattern, seed 0, against data-parallel and a single learner of the same seed,
into ``convergence-grid.json`` (points ordered by excess ÷ data-parallel's), rewritten after
every point.
"""

import itertools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_convergence_task as task
from bench_convergence_arms import run_gradientmail, run_local

GRID: dict[str, list[Any]] = {
    "outer_lr": [0.4, 0.7, 1.0],
    "outer_momentum": [0.0, 0.6, 0.9],
    "sync_every": [25, 50, 100],
    "quorum": ["0.5:3", "1.0:3"],
    "pattern": ["contiguous"],
}
"""The grid's default axes; ``quorum`` values are ``quorum_fraction:grace``."""
_POINT_KEY = ("outer_lr", "outer_momentum", "sync_every", "quorum_fraction", "grace", "pattern")


def _grid_axes(points: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The values each setting takes over ``points``, sorted."""
    return {key: sorted({point[key] for point in points}) for key in _POINT_KEY}


def _overrides(lr: Any, momentum: Any, quorum: Any, pattern: Any) -> dict[str, Any]:
    """The ``RunConfig`` fields one point sets but H (``quorum`` is ``fraction:grace``)."""
    fraction, grace = (float(x) for x in str(quorum).split(":"))
    return {
        "outer_lr": float(lr),
        "outer_momentum": float(momentum),
        "quorum_fraction": fraction,
        "grace": grace,
        "pattern": str(pattern),
    }


def _point(
    overrides: dict[str, Any],
    sync_every: int,
    report: dict[str, Any],
    references: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """One point's settings and figures, its excess against the references'."""
    return overrides | {
        "sync_every": sync_every,
        "final_loss": report["final_loss"],
        "excess": report["excess"],
        "excess_ratio_vs_dp": report["excess"] / references["dp"]["excess"],
        "excess_ratio_vs_single": report["excess"] / references["single"]["excess"],
        "rounds_committed": report["rounds_committed"],
        "mean_participants": report["mean_participants"],
        "wall_seconds": report["wall_seconds"],
    }


def _write(
    results: Path,
    quick: bool,
    parameters: dict[str, Any],
    references: dict[str, dict[str, Any]],
    points: list[dict[str, Any]],
) -> None:
    """The grid's file: ``points`` ordered by excess ÷ data-parallel's."""
    ordered = sorted(points, key=lambda point: point["excess_ratio_vs_dp"])
    parameters = parameters | {"axes": _grid_axes(ordered)}
    result = h.header(f"{task.NAME}-grid", quick=quick, parameters=parameters)
    result["figures"] = {
        "references": {
            arm: {"final_loss": r["final_loss"], "excess": r["excess"]}
            for arm, r in references.items()
        },
        "points": ordered,
    }
    h.write_result(results, f"{task.NAME}-grid", result)


def grid(
    results: Path,
    quick: bool,
    axes: dict[str, list[Any]],
    encoding: str,
    merge: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Every point of ``axes`` (``GRID``'s keys) as one gradientmail run on seed 0, against
    data-parallel and a single learner of the same seed; writes
    ``results/convergence-grid.json`` (points ordered by excess ÷ data-parallel's) after
    every point, so that an interrupted grid keeps what it measured. With ``merge``, the
    points already in that file stay, except those measured again (same settings)."""
    settings = task.plan(quick)
    path = results / f"{task.NAME}-grid.json"
    kept = json.loads(path.read_text())["figures"]["points"] if merge and path.exists() else []
    points = {tuple(point[key] for key in _POINT_KEY): point for point in kept}
    references = {arm: run_local(arm, 0, settings) for arm in ("dp", "single")}
    log(
        f"  dp: excess {references['dp']['excess']:.4f}; "
        f"single: {references['single']['excess']:.4f}"
    )
    parameters = {
        "steps": settings["steps"],
        "seed": 0,
        "encoding": encoding,
        "learners": task.K,
        "fragments": task.FRAGMENTS,
    }
    combos = itertools.product(
        *(axes[key] for key in ("outer_lr", "outer_momentum", "sync_every", "quorum", "pattern"))
    )
    with tempfile.TemporaryDirectory(prefix="gm-bench-grid-") as scratch:
        for n, (lr, momentum, sync_every, quorum, pattern) in enumerate(combos):
            overrides = _overrides(lr, momentum, quorum, pattern)
            report = run_gradientmail(
                0, int(sync_every), encoding, settings, Path(scratch) / str(n), overrides
            )
            point = _point(overrides, int(sync_every), report, references)
            points[tuple(point[key] for key in _POINT_KEY)] = point
            log(
                "  "
                + " ".join(f"{k}={v}" for k, v in overrides.items())
                + f" H={sync_every}: excess ÷ dp {point['excess_ratio_vs_dp']:.3f}"
                + f" ({report['wall_seconds']:.0f} s)"
            )
            _write(results, quick, parameters, references, list(points.values()))
    return path
