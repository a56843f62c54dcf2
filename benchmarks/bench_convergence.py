"""Convergence and bytes: gradientmail against synchronous data-parallel training.

The demo's transformer (its ``tiny`` shape, about 28k parameters, so that the whole matrix
fits the time budget on two cores) learns the demo's Markov language, whose entropy floor is
known exactly. Every arm sees the same sequences: learner ``k`` trains on shard ``k`` of the
corpus, and data-parallel's step ``t`` is the union of the learners' step-``t`` batches.

- ``dp``: one process, batch ``K × b``, the reference. Its bytes are what a ring all-reduce
  of fp32 gradients would move per learner, ``2 (K − 1) / K × 4 × params`` per step:
  computed, not measured.
- ``gm-{encoding}-H{H}``: ``K`` learner processes and one dedicated syncer process on a
  ``LocalMailbox``, ``F`` fragments, deltas and updates in ``encoding``, grace 3 s (longer
  than the learners drift apart with five processes on two cores, so that a round does not
  close without one of them; learners never wait on a round). A learner's bytes
  are measured by its node (``node.state``: bytes written and read) from the moment all
  learners have joined to the end of its closing flush; the syncer's are reported apart.
- ``single``: one learner, batch ``b``, the same steps (a quarter of the tokens).

Every arm uses AdamW (the inner optimizer for gradientmail) with the same learning-rate
schedule (linear warm-up, cosine decay to a tenth). Final evaluation loss is measured on a
fixed held-out set; excess is that minus the floor. Each gradientmail learner evaluates its
local model; the final figure is the mean over learners after the closing flush (they then
hold the same committed versions).

Usage: ``.venv/bin/python benchmarks/bench_convergence.py [--quick] [--results DIR]``.
The learner and syncer processes run this file with ``--worker``. The task (model, data,
schedule, config) is ``bench_convergence_task``, the arms' runs ``bench_convergence_arms``.

``--grid`` runs the defaults grid instead: one gradientmail run per point of outer lr ×
outer momentum × H × (quorum fraction, grace), seed 0, against data-parallel and a single
learner of the same seed, into ``convergence-grid.json``; ``--outer-lr``,
``--outer-momentum``, ``--sync-every``, ``--quorum F:G`` and ``--encoding`` set the axes
(``bench_convergence_grid.GRID`` has the defaults, 54 points: about 40 s each at full size
on two idle cores).

``--long STEPS`` measures only bytes (``bench_convergence_bytes``): int8 at H = 50 for
``STEPS`` steps, once per ``--checkpoint-every`` value (default 1 and 8), into
``convergence-bytes.json``: long enough that the closing flush is a small share of a
learner's bytes (reported).
"""

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_convergence_task as task
from _workers import learner_worker, syncer_worker
from bench_convergence_arms import run_gradientmail, run_local
from bench_convergence_bytes import long_bytes
from bench_convergence_grid import GRID, grid

PUBLISHED_GAP_PERCENT = 2.0
"""Streaming DiLoCo's relative loss gap to data-parallel at 4 replicas, small model."""


def _aggregate(per_seed: dict[str, dict[int, dict[str, Any]]], params: int) -> dict[str, Any]:
    """Per arm: final loss, excess, bytes and the ratios against ``dp`` of the same seed,
    summarized over seeds."""
    dp = per_seed["dp"]
    summaries: dict[str, Any] = {}
    for arm, seeds in per_seed.items():
        entry: dict[str, Any] = {
            "final_loss": h.summary([r["final_loss"] for r in seeds.values()]),
            "excess": h.summary([r["excess"] for r in seeds.values()]),
        }
        excess_ratios = [r["excess"] / dp[s]["excess"] for s, r in seeds.items()]
        gaps = [
            100 * (r["final_loss"] - dp[s]["final_loss"]) / dp[s]["final_loss"]
            for s, r in seeds.items()
        ]
        entry["excess_ratio_vs_dp"] = h.summary(excess_ratios)
        entry["relative_gap_percent_vs_dp"] = h.summary(gaps)
        if arm.startswith("gm-"):
            bytes_ = [r["bytes_per_learner"] for r in seeds.values()]
            entry["bytes_per_learner"] = h.summary(bytes_)
            entry["bytes_ratio_dp_over_gm"] = h.summary(
                [
                    dp[s]["bytes_per_learner_computed"] / r["bytes_per_learner"]
                    for s, r in seeds.items()
                ]
            )
            entry["bytes_ratio_with_syncer_share"] = h.summary(
                [
                    dp[s]["bytes_per_learner_computed"]
                    / (r["bytes_per_learner"] + r["syncer_bytes"] / task.K)
                    for s, r in seeds.items()
                ]
            )
            entry["mean_participants"] = h.summary([r["mean_participants"] for r in seeds.values()])
            entry["rounds_committed"] = h.summary(
                [float(r["rounds_committed"]) for r in seeds.values()]
            )
        elif arm == "dp":
            entry["bytes_per_learner"] = h.summary(
                [r["bytes_per_learner_computed"] for r in seeds.values()]
            )
        summaries[arm] = entry
    return summaries


def _targets(summaries: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for target in task.TARGETS:
        arm = summaries.get(target["arm"])
        if arm is None:
            checks.append(target | {"measured": False})
            continue
        excess = arm["excess_ratio_vs_dp"]["median"]
        bytes_ = arm["bytes_ratio_dp_over_gm"]["median"]
        checks.append(
            target
            | {
                "measured": True,
                "excess_ratio": excess,
                "bytes_ratio": bytes_,
                "excess_met": excess <= target["excess_ratio_max"],
                "bytes_met": bytes_ >= target["bytes_ratio_min"],
            }
        )
    return checks


def _parameters(settings: dict[str, Any], params: int) -> dict[str, Any]:
    """The results file's parameters: the plan's and the task's."""
    return settings | {
        "learners": task.K,
        "fragments": task.FRAGMENTS,
        "batch_per_learner": task.BATCH,
        "context": task.CONTEXT,
        "lr": task.LR,
        "model": "GPTConfig.tiny (d_model 32, 2 layers, 2 heads)",
        "params": params,
        "eval_sequences": task.EVAL_BATCHES * task.EVAL_BATCH_SIZE,
        "final_eval_sequences": task.FINAL_EVAL_BATCHES * task.EVAL_BATCH_SIZE,
    }


def _run_seed(
    seed: int,
    settings: dict[str, Any],
    per_seed: dict[str, dict[int, dict[str, Any]]],
    scratch: Path,
    log: Callable[[str], None],
) -> None:
    """Every arm the plan runs on ``seed`` (the gradientmail matrix on the first seed, the
    ``repeated`` arms on the others), into ``per_seed[arm][seed]``."""
    for arm in ("dp", "single"):
        per_seed.setdefault(arm, {})[seed] = run_local(arm, seed, settings)
        log(f"  {arm} seed {seed}: loss {per_seed[arm][seed]['final_loss']:.4f}")
    for encoding in settings["encodings"]:
        for sync_every in settings["sync_every"]:
            arm = f"gm-{encoding}-H{sync_every}"
            if seed != settings["seeds"][0] and arm not in settings["repeated"]:
                continue
            report = run_gradientmail(
                seed, sync_every, encoding, settings, scratch / f"{arm}-s{seed}"
            )
            per_seed.setdefault(arm, {})[seed] = report
            dp_bytes = per_seed["dp"][seed]["bytes_per_learner_computed"]
            log(
                f"  {arm} seed {seed}: loss {report['final_loss']:.4f}, "
                f"{report['bytes_per_learner'] / 1e6:.2f} MB/learner "
                f"({dp_bytes / report['bytes_per_learner']:.0f}x less than dp), "
                f"{report['rounds_committed']} rounds, {report['wall_seconds']:.0f} s"
            )


def run(
    results: Path,
    quick: bool,
    log: Callable[[str], None] = print,
    *,
    sparse: list[str] | None = None,
) -> Path:
    """Every arm for every seed; writes ``results/convergence.json`` and returns its path.
    With ``sparse``, those encodings (``SPARSE`` arms among them) instead of the plan's,
    into ``convergence-sparse.json``."""
    settings = task.plan(quick)
    if sparse:
        settings["encodings"] = sparse
    from gradientmail.demo.model import GPT

    params = GPT(task.model_config()).num_parameters()
    name = f"{task.NAME}-sparse" if sparse else task.NAME
    result = h.header(name, quick=quick, parameters=_parameters(settings, params))
    per_seed: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="gm-bench-convergence-") as scratch:
        for seed in settings["seeds"]:
            _run_seed(seed, settings, per_seed, Path(scratch), log)
    summaries = _aggregate(per_seed, params)
    result["figures"] = {
        "arms": summaries,
        "per_seed": {arm: {str(s): r for s, r in seeds.items()} for arm, seeds in per_seed.items()},
        "targets": _targets(summaries),
        "published_gap_percent": PUBLISHED_GAP_PERCENT,
    }
    return h.write_result(results, name, result)


def _worker(spec_path: Path, role: str) -> None:
    spec = json.loads(spec_path.read_text())
    if role == "syncer":
        result = syncer_worker(spec)
    else:
        result = learner_worker(spec, int(role), task.synthetic_learning(spec, int(role)))
    out = Path(spec["scratch"]) / f"result-{role}.json"
    out.write_text(json.dumps(result), encoding="utf-8")


def _print_arms(path: Path) -> None:
    """Each arm's median excess and ratios, from the results file at ``path``."""
    summaries = json.loads(path.read_text())["figures"]["arms"]
    for arm, entry in summaries.items():
        line = f"{arm:16} excess {entry['excess']['median']:.4f}"
        line += f"  ratio vs dp {entry['excess_ratio_vs_dp']['median']:.3f}"
        if "bytes_ratio_dp_over_gm" in entry:
            line += f"  bytes ratio {entry['bytes_ratio_dp_over_gm']['median']:.0f}x"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short seed, one config")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--grid", action="store_true", help="the defaults grid instead of the arms (see GRID)"
    )
    parser.add_argument(
        "--sparse",
        nargs="*",
        metavar="ENCODING",
        help="these encodings (default int8 and every SPARSE arm) into convergence-sparse.json",
    )
    parser.add_argument("--outer-lr", nargs="+", type=float, default=GRID["outer_lr"])
    parser.add_argument("--outer-momentum", nargs="+", type=float, default=GRID["outer_momentum"])
    parser.add_argument("--sync-every", nargs="+", type=int, default=GRID["sync_every"])
    parser.add_argument("--quorum", nargs="+", default=GRID["quorum"], help="FRACTION:GRACE pairs")
    parser.add_argument("--pattern", nargs="+", default=GRID["pattern"], help="fragment patterns")
    parser.add_argument("--encoding", default="fp32", help="the grid's delta/update encoding")
    parser.add_argument(
        "--merge", action="store_true", help="keep the grid file's other points (see grid)"
    )
    parser.add_argument(
        "--long", type=int, metavar="STEPS", help="only the bytes of LONG_ARM over STEPS steps"
    )
    parser.add_argument(
        "--checkpoint-every", nargs="+", type=int, default=[1, 8], help="--long's values"
    )
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    if args.long:
        print(f"wrote {long_bytes(args.results, args.long, args.checkpoint_every)}")
        return
    if args.grid:
        axes = {
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "sync_every": args.sync_every,
            "quorum": args.quorum,
            "pattern": args.pattern,
        }
        print(f"wrote {grid(args.results, args.quick, axes, args.encoding, args.merge)}")
        return
    sparse = None if args.sparse is None else (args.sparse or ["int8", *task.SPARSE])
    path = run(args.results, args.quick, sparse=sparse)
    _print_arms(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
