"""Real text over seeds: the measured defaults confirmed, and the same run repeated.

Three modes of ``bench_text.py`` (``--mode defaults``, ``repeat`` and ``rerun``), each the
same arms over several seeds (the seed draws the model's initialization and every learner's
batches) or one seed several times:

- ``defaults``: seeds 0, 1, 2; ``K`` = 4 learners, AdamW. ``gm-defaults`` is a run created
  with ``RunConfig()`` as it stands (the defaults chosen from the grid in
  ``bench_convergence.py --grid``), ``gm-previous`` one with the defaults before that grid
  (``PREVIOUS``), ``dp`` and ``single`` as in ``bench_text``. Written to
  ``text-defaults-{size}.json``.
- ``repeat``: seeds 0 … 4; 2 learners, each on its half of the training text, and the
  plain-SGD inner optimizer (``bench_text_task.inner_optimizer("sgd")``); ``gm-defaults``,
  ``dp`` (one model on both halves' batches) and ``single`` (one learner on the first half,
  the same steps: equal steps per learner), ``gm-unpaced`` and ``gm-overlap-5`` (below).
  Written to ``text-repeat-{size}.json``.
- ``rerun``: ``repeat``'s task on seed 0 alone, five times (``RERUNS``): the same model,
  batches and configuration, so what differs between runs is the timing of the learners'
  processes (which rounds close with whom, and when a learner takes an update), which is
  what made the issue's word_language_model port end 70% worse in one run of two. The local
  arms run every time too: their spread is the machine's own nondeterminism. The
  ``gm-overlap-N`` arms are the defaults with ``RunConfig.overlap = N`` (rounds that pace
  the learners: the same steps give the same run; the defaults pace too, with overlap 2),
  ``gm-unpaced`` the defaults with ``overlap = None`` (a learner takes each version at the
  first step after it is ready, a lag that varies with the timing). Written to
  ``text-rerun-{size}.json``.

Per row (a seed, or ``seed#run`` in ``rerun``): each arm's validation bits per byte, its
excess over ``dp`` of the same row, and whether each gradientmail arm ends below ``single``.
Over the rows: the summaries, and for each arm the spread ``max / min`` of its final bits
per byte and of its excess over ``dp``: of the excesses' magnitudes when every one has the
same sign (gradientmail can end below data-parallel), None when they straddle zero or one
is zero. The repeatability target: every row below ``single``, the excess within 1.3×.

At the quick size a row's arms run at once. The result file is rewritten after every run, so
that an interrupted mode keeps what it measured, and a later invocation keeps the runs of
the file it does not repeat (``--only dp single`` first, the gradientmail arms later, gives
one file; one that runs no arm, ``--only none``, recomputes the figures of the stored runs;
the runs of an arm the mode no longer has are dropped); each gradientmail run records its
``RunConfig``.
"""

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _harness as h
import bench_text_data as data
import bench_text_task as task
import msgspec
from bench_text_arms import run_gradientmail
from bench_text_training import run_local

PREVIOUS: dict[str, Any] = {
    "fragments": 4,
    "sync_every": 64,
    "pattern": "contiguous",
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "quorum_fraction": 0.5,
    "grace": 2.0,
    "overlap": None,
}
"""``RunConfig``'s defaults before the grid chose them (unpaced: ``overlap`` came later)."""
SPREAD_MAX = 1.3
RERUNS = 5
OVERLAP = "gm-overlap-"
"""The prefix of an arm with the defaults and ``RunConfig.overlap`` set to its suffix."""
UNPACED = "gm-unpaced"
"""The arm with the defaults and ``RunConfig.overlap = None``."""

MODES: dict[str, dict[str, Any]] = {
    "defaults": {
        "seeds": [0, 1, 2],
        "learners": 4,
        "inner": "adamw",
        "arms": ["dp", "single", "gm-defaults", "gm-previous"],
    },
    "repeat": {
        "seeds": [0, 1, 2, 3, 4],
        "learners": 2,
        "inner": "sgd",
        "arms": ["dp", "single", "gm-defaults", UNPACED, "gm-overlap-5"],
    },
    "rerun": {
        "seeds": [0],
        "reruns": RERUNS,
        "learners": 2,
        "inner": "sgd",
        "arms": ["dp", "single", "gm-defaults", UNPACED, "gm-overlap-5"],
    },
}


def config(arm: str) -> Any:
    """The ``RunConfig`` of a gradientmail arm: the defaults, ``gm-overlap-N`` the defaults
    with ``overlap = N``, ``UNPACED`` with none, or ``PREVIOUS`` over them."""
    from gradientmail.protocol.records import RunConfig

    if arm == "gm-defaults":
        return RunConfig()
    if arm == UNPACED:
        return RunConfig(overlap=None)
    overlap = overlap_of(arm)
    if overlap is not None:
        return RunConfig(overlap=overlap)
    return RunConfig(**PREVIOUS)


def overlap_of(arm: str) -> int | None:
    """The overlap of a ``gm-overlap-N`` arm, None for any other arm."""
    return int(arm.removeprefix(OVERLAP)) if arm.startswith(OVERLAP) else None


def run_arm(arm: str, size: str, seed: int, mode: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """One arm of a mode on one seed."""
    setup = {"learners": mode["learners"], "inner": mode["inner"]}
    if arm in ("dp", "single"):
        return run_local(arm, {"size": size, "seed": seed} | setup)
    chosen = config(arm)
    result = run_gradientmail(
        size, seed, 0, "fp32", scratch / f"{arm}-s{seed}", False, config=chosen, **setup
    )
    return result | {"config": msgspec.structs.asdict(chosen)}


def _runs(
    arms: list[str], size: str, seed: int, mode: dict[str, Any], scratch: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each arm's run on ``seed``, in the order of ``arms``: one after another, but at the
    quick size (smoke-test sizes, whose times nothing judges) all at once."""
    if size != "quick":
        for arm in arms:
            yield arm, run_arm(arm, size, seed, mode, scratch)
        return
    with ThreadPoolExecutor(max_workers=len(arms)) as pool:
        started = {arm: pool.submit(run_arm, arm, size, seed, mode, scratch) for arm in arms}
        for arm in arms:
            yield arm, started[arm].result()


def figures(per_seed: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per seed and over seeds, as the module docstring says, from each arm's results."""
    rows: dict[str, dict[str, Any]] = {}
    for seed, by_arm in per_seed.items():
        dp, single = by_arm.get("dp"), by_arm.get("single")
        row: dict[str, Any] = {}
        for arm, result in by_arm.items():
            entry: dict[str, Any] = {
                "bits_per_byte": result["bits_per_byte"],
                "wall_seconds": result["wall_seconds"],
            }
            if dp is not None:
                entry["excess_over_dp"] = result["bits_per_byte"] - dp["bits_per_byte"]
            if single is not None and arm.startswith("gm-"):
                entry["beats_single"] = result["bits_per_byte"] < single["bits_per_byte"]
            if "rounds_committed" in result:
                entry["rounds_committed"] = result["rounds_committed"]
                entry["rounds_without_all"] = result["rounds_without_all"]
                entry["mean_participants"] = result["mean_participants"]
            row[arm] = entry
        rows[seed] = row
    arms = sorted({arm for row in rows.values() for arm in row})
    over: dict[str, Any] = {}
    for arm in arms:
        entries = [row[arm] for row in rows.values() if arm in row]
        bits = [e["bits_per_byte"] for e in entries]
        summary: dict[str, Any] = {
            "bits_per_byte": h.summary(bits),
            "bits_per_byte_spread": max(bits) / min(bits),
        }
        excess = [e["excess_over_dp"] for e in entries if "excess_over_dp" in e]
        if excess and arm != "dp":
            summary["excess_over_dp"] = h.summary(excess)
            summary["excess_spread"] = _spread(excess)
        beats = [e["beats_single"] for e in entries if "beats_single" in e]
        if beats:
            summary["beats_single"] = sum(beats)
            summary["runs"] = len(beats)
        over[arm] = summary
    return {"per_seed": rows, "over_seeds": over}


def _spread(excess: list[float]) -> float | None:
    """``max / min`` of the excesses' magnitudes, or None when they do not share a sign."""
    if all(e > 0 for e in excess) or all(e < 0 for e in excess):
        magnitudes = [abs(e) for e in excess]
        return max(magnitudes) / min(magnitudes)
    return None


def rows(mode: dict[str, Any]) -> list[tuple[str, int]]:
    """The rows a mode runs, ``(label, seed)``: one per seed, or ``seed#run`` per rerun."""
    reruns = mode.get("reruns")
    if reruns is None:
        return [(str(seed), seed) for seed in mode["seeds"]]
    return [(f"{seed}#{run}", seed) for seed in mode["seeds"] for run in range(1, reruns + 1)]


def _parameters(
    size: str, mode_name: str, mode: dict[str, Any], chosen: list[str]
) -> dict[str, Any]:
    """The results file's parameters: the size's, the mode's (``chosen``: the arms run),
    the defaults, ``PREVIOUS``, the inner optimizer's and where the syncer ran."""
    from gradientmail.demo.model import GPT
    from gradientmail.protocol.records import RunConfig

    sgd = mode["inner"] == "sgd"
    return (
        {
            "size": size,
            "mode": mode_name,
            "arms": chosen,
            "params": GPT(task.model_config(task.SIZES[size])).num_parameters(),
            "corpus": data.stdlib_corpus(shards=mode["learners"], seed=0).description,
            "defaults": msgspec.structs.asdict(RunConfig()),
            "previous": PREVIOUS,
            "inner_lr": task.SGD_LR if sgd else task.LR,
            "sgd_clip": task.SGD_CLIP if sgd else None,
            "spread_max": SPREAD_MAX,
            "syncer_in": task.SYNCER_IN,
        }
        | {key: value for key, value in task.SIZES[size].items() if key != "model"}
        | mode
        | {"model": task.SIZES[size]["model"]}
    )


def run(
    results: Path,
    size: str,
    mode_name: str,
    seeds: list[int] | None,
    only: list[str] | None,
    log: Callable[[str], None] = print,
) -> Path:
    """Every arm of the mode (or ``only`` those) on every seed (or ``seeds``); writes
    ``results/text-{mode}-{size}.json`` after each run and returns its path."""
    mode = MODES[mode_name] | ({"seeds": seeds} if seeds else {})
    chosen = [arm for arm in mode["arms"] if only is None or arm in only]
    name = f"{task.NAME}-{mode_name}-{size}"
    parameters = _parameters(size, mode_name, mode, chosen)
    path = results / f"{name}.json"
    stored = json.loads(path.read_text()) if path.exists() else None
    per_seed: dict[str, dict[str, dict[str, Any]]] = {
        label: {arm: run for arm, run in row.items() if arm in MODES[mode_name]["arms"]}
        for label, row in (stored["figures"]["arms"] if stored else {}).items()
    }
    began = time.perf_counter()
    if not chosen and stored is not None:
        # Nothing to run: the figures again from the stored runs, under their own header.
        stored["figures"] = figures(per_seed) | {
            "arms": per_seed,
            "seconds_this_invocation": stored["figures"].get("seconds_this_invocation"),
        }
        path.write_text(json.dumps(stored, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path
    with tempfile.TemporaryDirectory(prefix="gm-bench-text-seeds-") as scratch:
        for label, seed in rows(mode):
            where = Path(scratch) / label.replace("#", "-")
            for arm, result in _runs(chosen, size, seed, mode, where):
                per_seed.setdefault(label, {})[arm] = result
                log(
                    f"  seed {label} {arm}: {result['bits_per_byte']:.4f} bits/byte, "
                    f"{result['wall_seconds']:.0f} s"
                )
                document = h.header(name, quick=size == "quick", parameters=parameters)
                document["figures"] = figures(per_seed) | {
                    "arms": per_seed,
                    "seconds_this_invocation": time.perf_counter() - began,
                }
                h.write_result(results, name, document)
    return path
