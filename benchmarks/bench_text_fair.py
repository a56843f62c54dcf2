"""Real text, gradientmail against torchft on equal terms: ``bench_text.py --mode fair``.

What makes the comparison fair, each point checked by ``tests/test_bench_text_quick.py``:

- torchft's ``Manager`` has ``init_sync=False`` (every learner starts from the same seed;
  torchft's default would overwrite learners 1 … K − 1 with learner 0's state at the first
  quorum).
- Both systems are judged on one model, by one function (``bench_text_eval.mean_model``):
  the mean of the learners' models at the end, after gradientmail's closing round and after
  torchft's last fragment sync, on the same held-out windows.
- Each system's outer optimizer is chosen, per H, from one grid, ``OUTER_GRID`` (rate ×
  momentum, Nesterov; torchft's example's 0.7 / 0.9 and gradientmail's default 1.0 / 0.6
  among them), on ``TUNING_SEED``, a seed the reported rows do not use; the grid and every
  point's figure, for both systems, are in the results file.
- Every reported seed (``SEEDS`` unless ``--seeds``) runs data-parallel once and, per H, the
  pair in both orders (gradientmail, torchft, torchft, gradientmail), each run with the load
  average at its start and end; a system's figure on a seed is the mean of its two runs.
- Bytes: gradientmail's measured (what each learner wrote and read); torchft's all-reduce
  payload measured by wrapping its process group, its ring traffic (sent and received)
  computed from it.

Figures per H: per seed, each system's bits per byte and excess over that seed's
data-parallel; over the seeds, the median excess of each; the wall ratio of the sums over
every run (and each order's). Written to ``text-fair-{size}.json`` after every run; H by H
(tuning, then the seeds' pairs), so an interrupted comparison holds whole H first, and
``--keep`` takes the file up where it stopped (a full-size comparison is some sixty runs
of seven minutes or more on two cores: several sittings). ``--overlap`` sets
gradientmail's ``RunConfig.overlap`` (0: the synchronous mode, which computes torchft's
model).
"""

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_text_task as task
from bench_text_arms import run_gradientmail, run_torchft
from bench_text_training import run_local

OUTER_GRID: tuple[tuple[float, float], ...] = ((0.7, 0.9), (0.7, 0.6), (1.0, 0.9), (1.0, 0.6))
"""torchft's outer (learning rate, momentum) candidates, Nesterov SGD."""
TUNING_SEED = 100
SEEDS = (0, 1, 2)
ORDER = ("gm", "torchft", "torchft", "gm")


def tune(
    system: str,
    size: str,
    sync_every: int,
    scratch: Path,
    log: Callable[[str], None],
    changes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``system`` (``gm`` or ``torchft``) at ``sync_every`` on ``TUNING_SEED`` for every point
    of ``OUTER_GRID``: each point's bits per byte and the best point."""
    points = []
    for lr, momentum in OUTER_GRID:
        where = scratch / f"tune-{system}-H{sync_every}-{lr}-{momentum}"
        run = _run(system, size, TUNING_SEED, sync_every, where, (lr, momentum), changes)
        points.append({"outer": [lr, momentum], "bits_per_byte": run["bits_per_byte"]})
        log(f"  tuning {system} H{sync_every} outer {lr}/{momentum}: {run['bits_per_byte']:.4f}")
    best = min(points, key=lambda point: point["bits_per_byte"])
    return {"seed": TUNING_SEED, "points": points, "best": best["outer"]}


def _run(
    system: str,
    size: str,
    seed: int,
    sync_every: int,
    where: Path,
    outer: tuple[float, ...],
    changes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run of ``system`` with the outer Nesterov SGD ``outer`` (rate, momentum);
    gradientmail's ``RunConfig`` with ``changes`` (``--overlap``)."""
    if system == "gm":
        config = task.run_config(
            sync_every,
            "fp32",
            outer_lr=outer[0],
            outer_momentum=outer[1],
            **(changes or {}),
        )
        return run_gradientmail(size, seed, sync_every, "fp32", where, False, config=config)
    return run_torchft(size, seed, sync_every, where, False, outer=outer)


def figures(per_h: dict[str, Any], dp: dict[str, Any]) -> dict[str, Any]:
    """Per H (``per_h[H]["runs"][seed][system]``: that system's runs in order), the figures
    the module docstring names."""
    out: dict[str, Any] = {}
    for sync_every, entry in per_h.items():
        rows: dict[str, Any] = {}
        walls = {"gm": 0.0, "torchft": 0.0}
        for seed, by_system in entry["runs"].items():
            row: dict[str, Any] = {}
            for system, runs in by_system.items():
                bits = statistics.fmean(run["bits_per_byte"] for run in runs)
                row[system] = {"bits_per_byte": bits, "runs": len(runs)}
                if seed in dp:
                    row[system]["excess_over_dp"] = bits - dp[seed]["bits_per_byte"]
                walls[system] += sum(run["wall_seconds"] for run in runs)
            rows[seed] = row
        complete = [
            row for row in rows.values() if all(row.get(s, {}).get("runs") == 2 for s in walls)
        ]
        summary: dict[str, Any] = {"rows": rows, "seeds_complete": len(complete)}
        for system in walls:
            excess = [
                row[system]["excess_over_dp"] for row in complete if "excess_over_dp" in row[system]
            ]
            summary[f"{system}_median_excess"] = statistics.median(excess) if excess else None
        summary["wall_ratio"] = h.ratio(walls["gm"], walls["torchft"]) if complete else None
        out[sync_every] = summary
    return out


def _compact(run: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "bits_per_byte",
        "bits_per_byte_by_learner",
        "learner_spread",
        "wall_seconds",
        "train_seconds",
        "cpu_seconds",
        "bytes_per_learner",
        "allreduce_payload_bytes",
        "load",
        "outer",
        "rounds_committed",
        "lag_steps_median",
        "curve",
    )
    return {key: run[key] for key in keys if key in run}


def _parameters(
    size: str, chosen: list[int], rows: list[int], changes: dict[str, Any] | None
) -> dict[str, Any]:
    """The results file's parameters: the task's, the H and seeds run, the order and both
    systems' outer optimizers (torchft's grid, gradientmail's defaults)."""
    config = task.run_config(chosen[0] if chosen else 1, "fp32", **(changes or {}))
    return {
        "size": size,
        "mode": "fair",
        "learners": task.learners(size),
        "fragments": task.FRAGMENTS,
        "sync_every": chosen,
        "seeds": rows,
        "order": list(ORDER),
        "steps": task.SIZES[size]["steps"],
        "model": task.SIZES[size]["model"],
        "harness": task.HARNESS,
        "syncer_in": task.SYNCER_IN,
        "torchft": {
            "outer_grid": [list(point) for point in OUTER_GRID],
            "tuning_seed": TUNING_SEED,
        },
        "gm": {"outer_grid": [list(point) for point in OUTER_GRID], "tuning_seed": TUNING_SEED},
        "gm_outer_default": [config.outer_lr, config.outer_momentum],
        "overlap": config.overlap,
    }


def _pairs(
    size: str,
    seed: int,
    sync_every: int,
    entry: dict[str, Any],
    scratch: Path,
    log: Callable[[str], None],
    write: Callable[[], None],
    changes: dict[str, Any] | None = None,
) -> None:
    """Both systems at ``sync_every`` on ``seed`` in ``ORDER``, each run into
    ``entry["runs"]`` (each system with ``entry``'s tuned outer optimizer), ``write`` after
    each; the turns a kept file already holds are not run again."""
    done = sum(len(runs) for runs in entry["runs"].get(str(seed), {}).values())
    for turn, system in list(enumerate(ORDER))[done:]:
        where = scratch / f"s{seed}-{system}-H{sync_every}-{turn}"
        tuned = entry["gm_tuning" if system == "gm" else "tuning"]["best"]
        result = _run(system, size, seed, sync_every, where, tuple(tuned), changes)
        runs = entry["runs"].setdefault(str(seed), {}).setdefault(system, [])
        runs.append(_compact(result) | {"turn": turn})
        log(
            f"  seed {seed} {system} H{sync_every} ({turn + 1} of 4): "
            f"{result['bits_per_byte']:.4f}, {result['wall_seconds']:.0f} s"
        )
        write()


def kept(path: Path, parameters: dict[str, Any]) -> dict[str, Any]:
    """What a results file at ``path`` already measured (its figures), to be taken up where
    it stopped; none when there is no file. Raises ``SystemExit`` naming the parameters that
    differ when it measured another comparison (its H and seeds may differ)."""
    if not path.exists():
        return {}
    stored = json.loads(path.read_text(encoding="utf-8"))
    before = stored["parameters"]
    free = ("sync_every", "seeds")
    differ = [k for k in parameters if k not in free and before.get(k) != parameters[k]]
    if differ:
        raise SystemExit(
            f"--keep: {path} measured another comparison ({', '.join(differ)} differ); "
            "run without --keep, or into another --results directory"
        )
    return dict(stored["figures"])


def _taken_up(stored: dict[str, Any], chosen: list[int]) -> dict[str, Any]:
    """Per H, what ``stored`` (a kept file's figures) measured: its runs and tunings; an
    empty entry for each H of ``chosen`` it has not begun."""
    per_h: dict[str, Any] = {key: {"runs": runs} for key, runs in stored.get("runs", {}).items()}
    for key, entry in per_h.items():
        for field in ("tuning", "gm_tuning"):
            if stored.get(field, {}).get(key) is not None:
                entry[field] = stored[field][key]
    for sync_every in chosen:
        per_h.setdefault(str(sync_every), {"runs": {}})
    return per_h


def run(
    results: Path,
    size: str,
    only: list[str] | None,
    seeds: list[int] | None,
    log: Callable[[str], None] = print,
    keep: bool = False,
    changes: dict[str, Any] | None = None,
) -> Path:
    """Per H both systems have at the size (``only``: the H whose arm names it lists): tune
    both, then every seed's data-parallel (once a seed) and pairs in both orders;
    gradientmail's ``RunConfig`` with ``changes``. With ``keep`` it takes up the results
    file where it stopped (``kept``): what it holds is not run again, so a comparison longer
    than one sitting is measured over several. Returns the file."""
    chosen = [
        s
        for s in task.SIZES[size]["torchft"]
        if only is None or {f"gm-fp32-H{s}", f"torchft-fp32-H{s}"} & set(only)
    ]
    rows = list(seeds or SEEDS)
    if TUNING_SEED in rows:
        raise SystemExit(f"--seeds: {TUNING_SEED} is the tuning seed; report other seeds")
    name = f"{task.NAME}-fair-{size}"
    parameters = _parameters(size, chosen, rows, changes)
    stored = kept(results / f"{name}.json", parameters) if keep else {}
    per_h = _taken_up(stored, chosen)
    dp: dict[str, Any] = dict(stored.get("dp", {}))
    began = time.perf_counter()

    def write() -> None:
        document = h.header(name, quick=size == "quick", parameters=parameters)
        document["figures"] = {
            "pairs": figures(per_h, dp),
            "tuning": {key: entry.get("tuning") for key, entry in per_h.items()},
            "gm_tuning": {key: entry.get("gm_tuning") for key, entry in per_h.items()},
            "dp": {seed: _compact(result) for seed, result in dp.items()},
            "runs": {key: entry["runs"] for key, entry in per_h.items()},
            "seconds": stored.get("seconds", 0.0) + time.perf_counter() - began,
        }
        h.write_result(results, name, document)

    with tempfile.TemporaryDirectory(prefix="gm-bench-text-fair-") as scratch:
        for sync_every in chosen:
            entry = per_h[str(sync_every)]
            for field, system in (("tuning", "torchft"), ("gm_tuning", "gm")):
                if field not in entry:
                    entry[field] = tune(system, size, sync_every, Path(scratch), log, changes)
                    write()
            for seed in rows:
                if str(seed) not in dp:
                    dp[str(seed)] = run_local("dp", {"size": size, "seed": seed})
                    log(f"  seed {seed} dp: {dp[str(seed)]['bits_per_byte']:.4f}")
                    write()
                _pairs(size, seed, sync_every, entry, Path(scratch), log, write, changes)
    return results / f"{name}.json"
