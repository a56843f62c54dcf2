"""Real text: gradientmail against data-parallel training and torchft's DiLoCo.

A byte-level GPT (the demo's model, vocabulary 256) learns the Python standard library's own
source: every ``*.py`` file under the running interpreter's ``sysconfig.get_paths()["stdlib"]``
(``site-packages`` excluded), in sorted order. A file belongs to validation when the sha256
of its path relative to that directory, read as a number, is 0 mod 20 (about 5% of the
files), so the split never depends on file sizes or on the order files were listed. The
training bytes are concatenated and cut into ``K`` contiguous shards; learner ``k`` draws
windows at random offsets of shard ``k`` (``bench_text_data.py``).

Every arm sees the same batches: learner ``k``'s step ``t`` is the same in every arm, and
data-parallel's step ``t`` is the union of the learners' step-``t`` batches. Every arm's
inner optimizer is AdamW with ``bench_convergence_task.train``'s schedule (linear warm-up,
cosine decay to a tenth); a learner restarted after a kill resumes at its recorded step on a
new stream of its shard.

- ``dp``: one process, batch ``K × b``: the reference. Bytes: a ring all-reduce of fp32
  gradients per step, ``2 (K − 1) / K × 4 × params`` per learner (computed).
- ``single``: one learner, batch ``b``, the same steps: the DiLoCo ordering check is that
  every ``K``-learner arm ends below it at equal steps per learner.
- ``gm-{encoding}-H{H}``: ``K`` learner processes on a ``LocalMailbox`` (``_workers``),
  learner 0's running the syncer beside its own node (``SYNCER_IN``), ``F`` fragments.
  Bytes are measured by each learner's node (written and read, from when all joined to the
  end of its flush).
  The nodes poll every 0.05 s and beat their lease every 0.5 s (gone after 5 s); the
  full size, where a step takes about 0.3 s on two cores, polls every 0.5 s and leases on
  the product's defaults (2 s, gone after 10 s). Polling costs an idle node CPU that on two
  shared cores comes out of training (``bench_overhead.py``'s idle arm: a learner 1.5% of
  a core at 0.05 s, 0.4% at 0.25 s, 0.2% at 0.5 s); polling every 0.25 s with a 0.5 s
  lease, an earlier full run's gradientmail arms took 1.01–1.03× torchft's wall time, on
  this pacing 0.96–1.00×. A pair run once also carries this machine's drift (consecutive
  arms differ by up to 6% in CPU per step for the same training, either way), more than
  the margins: ``--mode timing`` runs each fp32 pair in both orders
  (``bench_text_timing``).
  Every process's CPU time (user and system, all threads) is reported, and the lag: the
  local steps between a learner's snapshot and its applying that round (``FragmentAligned``),
  median and maximum over every learner's rounds.
- ``torchft-fp32-H{H}``: ``K`` processes, each its own replica group of one, with
  ``torchft.local_sgd.DiLoCo`` over the same fragments (``bench_text_torchft.py``), its
  lighthouse process and gloo process groups on 127.0.0.1, ``init_sync=False``. Bytes: what
  its process group's all-reduce is handed (measured), sent and received by a ring,
  ``2 × 2 (p − 1) / p × bytes`` with ``p`` the sync's participants (computed from it).
- ``*-kill``: the same as the arm named, with learner 1 SIGKILLed at 40% of its steps and
  restarted 20 s later.

Validation loss is in bits per byte on a fixed set of windows of the validation files; the
final figure of a distributed arm is that of one model, the mean of the learners' models at
the end (``bench_text_eval.mean_model``: after gradientmail's closing round, after torchft's
last sync), each learner's own given apart. ``--mode fair`` (``bench_text_fair``) compares
the two systems over seeds, torchft's outer optimizer tuned on another seed.
Usage: ``.venv/bin/python benchmarks/bench_text.py
[--size quick|small|medium|full] [--results DIR] [--only ARM ...]
[--mode arms|defaults|repeat|rerun|timing|fair] [--seeds N ...] [--overlap N|none] [--keep]``
(``--overlap``: the gradientmail arms with that ``RunConfig.overlap`` rather than the
default's; ``--keep``: the results file keeps the stored runs of the arms (``--mode timing``:
the pairs) not run now, every run marked with the invocation that measured it, and
gradientmail ÷ torchft time ratios only for a pair from one invocation; ``bench_text_seeds`` has the
modes over seeds: the defaults confirmed, and repeatability with plain SGD over seeds and
over reruns of one seed;
``bench_text_timing`` the fp32 pairs' wall time, each pair in both orders); ``nox -s bench-text``
runs the full size (1,000 steps, a 1M-parameter GPT); ``medium`` is 1,000 steps of the
119k-parameter GPT of ``small`` (200 steps). The worker
processes run this file with ``--worker``. The sizes and arms are ``bench_text_task``'s,
the arms' runs ``bench_text_arms``'s.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_text_data as data
import bench_text_failure
import msgspec
from _workers import learner_worker
from bench_text_arms import run_arm
from bench_text_task import (
    FRAGMENTS,
    HARNESS,
    KILL_AT,
    KILLED,
    LR,
    NAME,
    SIZES,
    SYNCER_IN,
    arms,
    invocation,
    learners,
    model_config,
    run_config,
)
from bench_text_training import learning


def together(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two arms' runs came from one invocation (``measured``; a run without it is
    from a file that one invocation wrote whole): only then is the ratio of their times a
    measurement, this machine's speed drifting by far more than the margins between
    invocations."""
    return a.get("measured") == b.get("measured")


def _figures(per_arm: dict[str, dict[str, Any]], size: dict[str, Any]) -> dict[str, Any]:
    """The table's figures per arm, gradientmail ÷ torchft at each H (the time ratios only
    for a pair measured ``together``), the failure side by side and the ordering check,
    from the arms' results."""
    dp = per_arm.get("dp")
    single = per_arm.get("single")
    table: dict[str, Any] = {}
    for arm, result in per_arm.items():
        entry = {
            "bits_per_byte": result["bits_per_byte"],
            "wall_seconds": result["wall_seconds"],
            "train_seconds": result["train_seconds"],
            "bytes_per_learner": result.get("bytes_per_learner"),
        }
        if dp is not None:
            entry["excess_over_dp"] = result["bits_per_byte"] - dp["bits_per_byte"]
        if single is not None and arm not in ("dp", "single"):
            entry["beats_single"] = result["bits_per_byte"] < single["bits_per_byte"]
        table[arm] = entry
    versus = {}
    for sync_every in size["torchft"]:
        gm, ft = per_arm.get(f"gm-fp32-H{sync_every}"), per_arm.get(f"torchft-fp32-H{sync_every}")
        if gm is None or ft is None:
            continue
        timed = together(gm, ft)
        versus[str(sync_every)] = {
            "bits_per_byte_ratio": gm["bits_per_byte"] / ft["bits_per_byte"],
            "excess_over_dp": [
                table[f"gm-fp32-H{sync_every}"].get("excess_over_dp"),
                table[f"torchft-fp32-H{sync_every}"].get("excess_over_dp"),
            ],
            "measured_together": timed,
            "bytes_ratio": h.ratio(gm["bytes_per_learner"], ft["bytes_per_learner"]),
        } | {
            # A run kept from before CPU time was measured has no cpu_seconds.
            f"{key}_ratio": h.ratio(gm[f"{key}_seconds"], ft[f"{key}_seconds"])
            if timed and f"{key}_seconds" in gm and f"{key}_seconds" in ft
            else None
            for key in ("wall", "train", "cpu")
        }
    failure = {
        arm: bench_text_failure.failure(
            bench_text_failure.kill_times(result), result["learners"], size["eval_every"]
        )
        | {"bits_per_byte": result["bits_per_byte"]}
        for arm, result in per_arm.items()
        if "failure" in result
    }
    return {"table": table, "versus_torchft": versus, "failure": failure}


_SAME = (
    "size",
    "seed",
    "learners",
    "fragments",
    "pattern",
    "lr",
    "steps",
    "batch",
    "model",
    "corpus",
)
"""The parameters a kept run must share with the invocation that keeps it."""
_UNSAID = {"seed": 0}
"""What a file measured before it recorded a parameter: seed 0."""


def kept(path: Path, parameters: dict[str, Any], chosen: list[str]) -> dict[str, dict[str, Any]]:
    """The runs of ``path``'s arms that ``chosen`` does not repeat, each with its
    ``measured`` (when, at which commit, with which ``RunConfig.overlap`` its invocation
    ran it: the stored file's header for a run without one); none when there is no file.
    Raises ``SystemExit`` naming the parameters that differ when the stored runs measured
    another task."""
    if not path.exists():
        return {}
    stored = json.loads(path.read_text(encoding="utf-8"))
    before = stored["parameters"]
    differ = [key for key in _SAME if before.get(key, _UNSAID.get(key)) != parameters.get(key)]
    if differ:
        raise SystemExit(
            f"--keep: the runs in {path} measured another task ({', '.join(differ)} differ); "
            "run every arm without --keep, or keep them in another --results directory"
        )
    header = invocation(stored)
    return {
        arm: {"measured": header} | run
        for arm, run in stored["figures"]["arms"].items()
        if arm not in chosen and arm in arms(before)
    }


def _chosen(size_name: str, only: list[str] | None) -> list[str]:
    """The arms of the size that ``only`` names (all when None), in their order;
    ``SystemExit`` listing the size's arms when it names none."""
    size = SIZES[size_name]
    chosen = [arm for arm in arms(size) if only is None or arm in only]
    if not chosen:
        raise SystemExit(
            f"no arm of size {size_name} is named by --only {' '.join(only or [])}: "
            f"the arms are {' '.join(arms(size))}"
        )
    return chosen


def _parameters(
    size_name: str, chosen: list[str], changes: dict[str, Any], seed: int
) -> dict[str, Any]:
    """The results file's parameters: the task's, the size's, the seed and the arms run."""
    from gradientmail.demo.model import GPT

    size = SIZES[size_name]
    corpus = data.stdlib_corpus(shards=learners(size_name), seed=0)
    config = msgspec.structs.replace(run_config(size["kill_sync_every"], "fp32"), **changes)
    return (
        {
            "size": size_name,
            "learners": learners(size_name),
            "fragments": FRAGMENTS,
            "pattern": "contiguous",
            "outer_lr": config.outer_lr,
            "outer_momentum": config.outer_momentum,
            "lr": LR,
            "overlap": config.overlap,
            "arms": chosen,
            "seed": seed,
            "harness": HARNESS,
            "syncer_in": SYNCER_IN,
            "params": GPT(model_config(size)).num_parameters(),
            "corpus": corpus.description,
            "kill": {
                "learner": KILLED,
                "at_fraction": KILL_AT,
                "restart_after": size["restart_after"],
            },
        }
        | {key: value for key, value in size.items() if key != "model"}
        | {"model": size["model"]}
    )


def _line(arm: str, run: dict[str, Any]) -> str:
    """One arm's line of the log: bits per byte, wall time, bytes per learner."""
    return f"  {arm}: {run['bits_per_byte']:.4f} bits/byte, {run['wall_seconds']:.0f} s" + (
        f", {run['bytes_per_learner'] / 1e6:.2f} MB/learner" if run.get("bytes_per_learner") else ""
    )


def run(
    results: Path,
    size_name: str,
    only: list[str] | None,
    log: Callable[[str], None] = print,
    changes: dict[str, Any] | None = None,
    keep: bool = False,
    seed: int = 0,
) -> Path:
    """Every arm of the size (or ``only`` those) on ``seed``, the gradientmail arms'
    ``RunConfig`` with ``changes``; writes ``results/text.json`` (full size) or
    ``results/text-{size}.json``. With ``keep`` the file keeps the runs of the arms this
    invocation does not run (``kept``), and every run says which invocation measured it
    (``measured``); a kept torchft run measured without the fair harness leaves the file
    without ``harness``, so that its comparisons judge nothing."""
    size = SIZES[size_name]
    chosen = _chosen(size_name, only)
    parameters = _parameters(size_name, chosen, changes or {}, seed)
    name = NAME if size_name == "full" else f"{NAME}-{size_name}"
    result = h.header(name, quick=size_name == "quick", parameters=parameters)
    measured = invocation(result)
    stored = kept(results / f"{name}.json", parameters, chosen) if keep else {}
    earlier = [
        arm
        for arm, run in stored.items()
        if arm.startswith("torchft") and run["measured"].get("harness") != HARNESS
    ]
    if earlier:
        log(f"  kept {', '.join(earlier)} of an earlier harness: the file judges no comparison")
        del result["parameters"]["harness"]
    per_arm: dict[str, dict[str, Any]] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gm-bench-text-") as scratch:
        for arm in chosen:
            per_arm[arm] = {"measured": measured} | run_arm(
                arm, size_name, seed, Path(scratch), changes
            )
            log(_line(arm, per_arm[arm]))
            # After every arm, so that an interrupted run keeps what it measured.
            runs = per_arm | stored
            every = {a: runs[a] for a in arms(size) if a in runs}
            result["parameters"]["arms"] = list(every)
            result["figures"] = _figures(every, size) | {
                "arms": every,
                "total_seconds": time.perf_counter() - began,
            }
            h.write_result(results, name, result)
    return results / f"{name}.json"


def _worker(spec_path: Path, role: str) -> None:
    spec = json.loads(spec_path.read_text())
    if spec["system"] == "gm":
        result = learner_worker(spec, int(role), learning(spec, int(role)))
    else:
        import bench_text_torchft

        result = bench_text_torchft.worker(spec, int(role))
    times = os.times()
    result["cpu_seconds"] = times.user + times.system
    out = Path(spec["scratch"]) / f"result-{role}.json"
    out.write_text(json.dumps(result), encoding="utf-8")


def _one_seed(seeds: list[int] | None) -> int:
    """The seed of ``--mode arms`` (0 unless ``--seeds`` names one)."""
    if seeds is not None and len(seeds) != 1:
        raise SystemExit(f"--seeds: --mode arms runs one seed, got {len(seeds)}")
    return 0 if seeds is None else seeds[0]


def _overlap(text: str) -> dict[str, int | None]:
    """``--overlap``'s change to the ``RunConfig``: a number of steps, or ``none``."""
    if text == "none":
        return {"overlap": None}
    try:
        return {"overlap": int(text)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of steps or none, got {text!r}"
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="full", help="steps and model size")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    parser.add_argument("--only", nargs="+", help="run only these arms (see the docstring)")
    parser.add_argument(
        "--mode",
        choices=("arms", "defaults", "repeat", "rerun", "timing", "fair"),
        default="arms",
        help="every arm once (the default), bench_text_seeds' defaults, repeat or rerun mode, "
        "bench_text_timing's fp32 pairs in both orders, or bench_text_fair's comparison",
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        help="the seeds of --mode defaults|repeat|rerun|fair; one seed for --mode arms (default 0)",
    )
    parser.add_argument(
        "--overlap",
        type=_overlap,
        default={},
        dest="changes",
        help="RunConfig.overlap of the gradientmail arms, a number of steps or none "
        "(--mode arms|timing|fair; default: the default's)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the stored runs of the arms (--mode timing: the pairs) not run now in the "
        "results file (--mode arms|timing); --mode fair: take the results file up where it "
        "stopped",
    )
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    if args.mode == "fair":
        import bench_text_fair

        path = bench_text_fair.run(
            args.results, args.size, args.only, args.seeds, keep=args.keep, changes=args.changes
        )
    elif args.mode == "timing":
        import bench_text_timing

        path = bench_text_timing.run(
            args.results, args.size, args.only, keep=args.keep, changes=args.changes
        )
    elif args.mode != "arms":
        import bench_text_seeds

        path = bench_text_seeds.run(args.results, args.size, args.mode, args.seeds, args.only)
    else:
        path = run(
            args.results,
            args.size,
            args.only,
            changes=args.changes,
            keep=args.keep,
            seed=_one_seed(args.seeds),
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
