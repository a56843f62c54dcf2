"""Real text, wall time only: each fp32 pair of ``bench_text`` run in both orders.

This machine's speed drifts by more than the margins measured: in one full run the same
learner work cost 0.19 s of CPU per step in one arm and 0.24 s in another, and consecutive
arms differ by ±6% in CPU per step for the same training. A pair run once, gradientmail then
torchft, folds that drift into its ratio. ``--mode timing`` runs, for every H that both
systems have at the size, the arms in the order gradientmail, torchft, torchft, gradientmail
(ABBA): a drift that is linear over the four arms weighs on both systems alike.

Per H (``figures["pairs"]``): each run's wall, training and CPU seconds and bits per byte;
the ratio of the sums (``wall_ratio``: both gradientmail runs' wall over both torchft runs',
likewise ``train_ratio`` and ``cpu_ratio``), and each order's own ratio
(``wall_ratio_gm_first``, ``wall_ratio_torchft_first``). Written to
``text-timing-{size}.json`` after every run, so an interrupted mode keeps what it measured.
Every pair says which invocation measured it (``measured``: when, at which commit, with which
``RunConfig.overlap``); with ``--keep`` the file keeps the stored pairs of the H not run now
(without it, a later invocation starts over).
"""

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_text_task as task
from bench_text_arms import run_gradientmail, run_torchft

ORDER = ("gm", "torchft", "torchft", "gm")
"""The systems of each H, in the order they run."""


def arm_name(system: str, sync_every: int) -> str:
    return f"{system}-fp32-H{sync_every}"


def figures(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per H (``runs[H][system]``: that system's runs in the order they ran), the ratios the
    module docstring names; an H still missing a run has only its runs."""
    out: dict[str, Any] = {}
    for sync_every, by_system in runs.items():
        gm, ft = by_system.get("gm", []), by_system.get("torchft", [])
        entry: dict[str, Any] = {
            system: [
                {
                    key: run[key]
                    for key in ("wall_seconds", "train_seconds", "cpu_seconds", "bits_per_byte")
                }
                for run in system_runs
            ]
            for system, system_runs in (("gm", gm), ("torchft", ft))
        }
        if len(gm) == 2 and len(ft) == 2:
            for key in ("wall", "train", "cpu"):
                field = f"{key}_seconds"
                entry[f"{key}_ratio"] = h.ratio(
                    gm[0][field] + gm[1][field], ft[0][field] + ft[1][field]
                )
            entry["wall_ratio_gm_first"] = h.ratio(gm[0]["wall_seconds"], ft[0]["wall_seconds"])
            entry["wall_ratio_torchft_first"] = h.ratio(
                gm[1]["wall_seconds"], ft[1]["wall_seconds"]
            )
        out[sync_every] = entry
    return out


def kept(path: Path, parameters: dict[str, Any], chosen: list[int]) -> dict[str, Any]:
    """The pairs stored in ``path`` of the H that ``chosen`` does not repeat, each with its
    ``measured`` (the stored file's header for a pair without one); none when there is no
    file. Raises ``SystemExit`` naming the parameters that differ when the stored pairs
    measured another task."""
    if not path.exists():
        return {}
    stored = json.loads(path.read_text(encoding="utf-8"))
    before = stored["parameters"]
    same = ("size", "learners", "fragments", "steps", "model", "pacing")
    differ = [key for key in same if before.get(key) != parameters.get(key)]
    if differ:
        raise SystemExit(
            f"--keep: the pairs in {path} measured another task ({', '.join(differ)} differ); "
            "run without --keep, or keep them in another --results directory"
        )
    header = task.invocation(stored)
    return {
        sync_every: {"measured": header} | pair
        for sync_every, pair in stored["figures"]["pairs"].items()
        if int(sync_every) not in chosen
    }


def _parameters(
    size_name: str, chosen: list[int], changes: dict[str, Any] | None
) -> dict[str, Any]:
    """The results file's parameters: the task's, the H run, the order and the harness."""
    size = task.SIZES[size_name]
    return {
        "size": size_name,
        "mode": "timing",
        "learners": task.learners(size_name),
        "fragments": task.FRAGMENTS,
        "sync_every": chosen,
        "order": list(ORDER),
        "steps": size["steps"],
        "model": size["model"],
        "pacing": size.get("pacing"),
        "overlap": task.run_config(size["sync_every"][0], "fp32", **(changes or {})).overlap,
        "harness": task.HARNESS,
        "syncer_in": task.SYNCER_IN,
    }


def run(
    results: Path,
    size_name: str,
    only: list[str] | None,
    log: Callable[[str], None] = print,
    keep: bool = False,
    changes: dict[str, Any] | None = None,
) -> Path:
    """Every H of the size that both systems have (``only``: those whose arm names it lists,
    ``gm-fp32-H{H}`` or ``torchft-fp32-H{H}``), in the ABBA order, gradientmail's
    ``RunConfig`` with ``changes`` (``--overlap``); with ``keep`` the file keeps the stored
    pairs of the other H (``kept``). Returns the file."""
    size = task.SIZES[size_name]
    chosen = [
        s
        for s in size["torchft"]
        if s in size["sync_every"]
        and (only is None or {arm_name("gm", s), arm_name("torchft", s)} & set(only))
    ]
    name = f"{task.NAME}-timing-{size_name}"
    parameters = _parameters(size_name, chosen, changes)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    began = time.perf_counter()
    path = results / f"{name}.json"
    stored = kept(path, parameters, chosen) if keep else {}
    measured = task.invocation(h.header(name, quick=size_name == "quick", parameters=parameters))
    with tempfile.TemporaryDirectory(prefix="gm-bench-text-timing-") as scratch:
        for sync_every in chosen:
            for turn, system in enumerate(ORDER):
                arm = arm_name(system, sync_every)
                where = Path(scratch) / f"{arm}-{turn}"
                if system == "gm":
                    config = task.run_config(sync_every, "fp32", **(changes or {}))
                    result = run_gradientmail(
                        size_name, 0, sync_every, "fp32", where, False, config=config
                    )
                else:
                    result = run_torchft(size_name, 0, sync_every, where, False)
                runs.setdefault(str(sync_every), {}).setdefault(system, []).append(result)
                log(f"  {arm} ({turn + 1} of 4): {result['wall_seconds']:.0f} s")
                document = h.header(name, quick=size_name == "quick", parameters=parameters)
                pairs = {key: {"measured": measured} | pair for key, pair in figures(runs).items()}
                document["figures"] = {
                    "pairs": dict(sorted((stored | pairs).items(), key=lambda item: int(item[0]))),
                    "seconds": time.perf_counter() - began,
                }
                path = h.write_result(results, name, document)
    return path
