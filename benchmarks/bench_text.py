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
inner optimizer is AdamW with ``bench_convergence.train``'s schedule (linear warm-up,
cosine decay to a tenth); a learner restarted after a kill resumes at its recorded step on a
new stream of its shard.

- ``dp``: one process, batch ``K × b``: the reference. Bytes: a ring all-reduce of fp32
  gradients per step, ``2 (K − 1) / K × 4 × params`` per learner (computed).
- ``single``: one learner, batch ``b``, the same steps: the DiLoCo ordering check is that
  every ``K``-learner arm ends below it at equal steps per learner.
- ``gm-{encoding}-H{H}``: ``K`` learner processes and a dedicated syncer process on a
  ``LocalMailbox`` (``bench_convergence``'s workers), ``F`` fragments. Bytes are measured by
  each learner's node (written and read, from when all joined to the end of its flush).
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
processes run this file with ``--worker``.
"""

import argparse
import itertools
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _harness as h
import bench_convergence as bc
import bench_text_data as data
import bench_text_eval as evaluation_module
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
KILLED = 1
KILL_AT = 0.4
LR = 2e-3

SIZES: dict[str, dict[str, Any]] = {
    "quick": {
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


def run_config(sync_every: int, encoding: str) -> Any:
    """The gradientmail arms' config: ``bench_convergence``'s (grace 3 s), ``F`` fragments."""
    return msgspec.structs.replace(
        bc.run_config(sync_every, encoding), fragments=FRAGMENTS, pattern="contiguous"
    )


def _bits(nats: float) -> float:
    return nats / math.log(2)


# -- one learner's work, in any process -------------------------------------------------


SGD_LR = 3.0
SGD_CLIP = 0.25
"""The plain-SGD inner optimizer (``inner="sgd"``): peak learning rate and the gradient-norm
clip, as pytorch/examples' word language model trains (SGD, clipping 0.25). The rate is
this transformer's: the best of 0.3, 1, 3 and 10 for the single arm at size ``medium``
(3.70, 3.49, 3.37 and 3.92 bits per byte after 1,000 steps, seed 0; AdamW: 3.15)."""


def inner_optimizer(name: str, model: Any) -> tuple[Any, float]:
    """The inner optimizer ``name`` (``adamw`` or ``sgd``) over ``model``'s parameters and its
    peak learning rate (``bench_convergence.train`` schedules it)."""
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


def learning(spec: dict[str, Any], index: int) -> bc.Learning:
    """Learner ``index``'s model, inner optimizer (``spec["inner"]``, AdamW when absent),
    batches (shard ``index`` of ``spec["learners"]``) and evaluation (``spec`` as ``_spec``
    writes it); a restarted learner (its progress file exists) draws stream 1."""
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    size = SIZES[spec["size"]]
    corpus = data.stdlib_corpus(shards=spec["learners"], seed=spec["seed"])
    length = size["model"]["context"]
    evaluation = corpus.evaluation(*size["eval"], length=length)
    final_set = corpus.evaluation(*size["final_eval"], length=length)
    model = GPT(model_config(size), seed=spec["seed"])
    optimizer, lr = inner_optimizer(spec.get("inner", "adamw"), model)
    progress_path = Path(spec["scratch"]) / f"progress-{index}"
    stream = 1 if progress_path.exists() else 0
    batches = corpus.train(index, batch_size=size["batch"], length=length, stream=stream)

    def run(first: int, after_step: Callable[[], None]) -> list[list[float]]:
        return bc.train(
            model,
            batches,
            steps=size["steps"],
            eval_every=size["eval_every"],
            evaluation=evaluation,
            after_step=after_step,
            first=first,
            lr=lr,
            optimizer=optimizer,
        )

    def final() -> float:
        evaluation_module.save(model, Path(spec["scratch"]), index)
        return evaluate(model, final_set)

    return bc.Learning(model, size["batch"] * length, run, final, optimizer)


def run_local(arm: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The ``dp`` or ``single`` arm, in this process on one thread: ``spec["learners"]``
    (``K`` when absent) shards, trained with ``spec["inner"]`` (AdamW when absent)."""
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    load = os.getloadavg()
    size = SIZES[spec["size"]]
    shards = spec.get("learners", K)
    corpus = data.stdlib_corpus(shards=shards, seed=spec["seed"])
    length = size["model"]["context"]
    learners = shards if arm == "dp" else 1
    streams = [corpus.train(k, batch_size=size["batch"], length=length) for k in range(learners)]

    def union() -> Any:
        while True:
            yield torch.cat([next(stream) for stream in streams])

    model = GPT(model_config(size), seed=spec["seed"])
    optimizer, lr = inner_optimizer(spec.get("inner", "adamw"), model)
    started = time.perf_counter()
    curve = bc.train(
        model,
        union(),
        steps=size["steps"],
        eval_every=size["eval_every"],
        evaluation=corpus.evaluation(*size["eval"], length=length),
        lr=lr,
        optimizer=optimizer,
    )
    seconds = time.perf_counter() - started
    final = evaluate(model, corpus.evaluation(*size["final_eval"], length=length))
    params = model.num_parameters()
    result: dict[str, Any] = {
        "final_loss": final,
        "bits_per_byte": _bits(final),
        "curve": [*curve, [float(size["steps"]), final]],
        "wall_seconds": seconds,
        "train_seconds": seconds,
        "params": params,
        "load": {"start": list(load), "end": list(os.getloadavg())},
    }
    if arm == "dp":
        result["bytes_per_learner"] = 2 * (shards - 1) / shards * 4 * params * size["steps"]
    return result


# -- the distributed arms ---------------------------------------------------------------


def _spec(size_name: str, seed: int, scratch: Path, **extra: Any) -> dict[str, Any]:
    return (
        {
            "size": size_name,
            "seed": seed,
            "steps": SIZES[size_name]["steps"],
            "learners": K,
            "scratch": str(scratch),
        }
        | SIZES[size_name].get("pacing", {})
        | extra
    )


def _kill(size: dict[str, Any], killed: bool) -> bc.Kill | None:
    if not killed:
        return None
    return bc.Kill(KILLED, int(size["steps"] * KILL_AT), size["restart_after"])


def run_gradientmail(
    size_name: str,
    seed: int,
    sync_every: int,
    encoding: str,
    scratch: Path,
    killed: bool,
    **setup: Any,
) -> dict[str, Any]:
    """``K`` learner processes and a syncer on a directory; the arm's figures. ``setup``
    may name ``config`` (a whole ``RunConfig``, instead of ``run_config(sync_every,
    encoding)``), ``learners`` (instead of ``K``) and ``inner`` (the inner optimizer)."""
    size = SIZES[size_name]
    config = setup.get("config") or run_config(sync_every, encoding)
    learners_count = setup.get("learners", K)
    spec = _spec(
        size_name,
        seed,
        scratch,
        system="gm",
        config=msgspec.structs.asdict(config),
        learners=learners_count,
        inner=setup.get("inner", "adamw"),
    )
    load = os.getloadavg()
    launched = bc.launch(Path(__file__).resolve(), spec, kill=_kill(size, killed))
    learners = [launched["reports"][str(k)] for k in range(learners_count)]
    syncer = launched["reports"]["syncer"]
    rounds = syncer["rounds"]
    lags = [lag for r in learners for lag in r["lag_steps"]]
    summary = _summary(launched, learners, size["eval_every"], spec, load)
    return summary | {
        "cpu_seconds": summary["cpu_seconds"] + syncer["cpu_seconds"],
        "bytes_per_learner": sum(r["bytes_up"] + r["bytes_down"] for r in learners)
        / learners_count,
        "syncer_bytes": syncer["bytes_up"] + syncer["bytes_down"],
        "peak_store_bytes": launched["peak_store_bytes"],
        "rounds_committed": len(rounds),
        "mean_participants": sum(r["participants"] for r in rounds) / max(1, len(rounds)),
        "rounds_without_all": sum(1 for r in rounds if r["participants"] < learners_count),
        "rejected": sum(len(r["rejected"]) for r in rounds),
        "rejected_by_round": {str(r["round"]): r["rejected"] for r in rounds if r["rejected"]},
        "participants_by_round": [r["participants"] for r in rounds],
        "lag_steps_median": statistics.median(lags) if lags else None,
        "lag_steps_max": max(lags, default=None),
    }


@contextmanager
def lighthouse(log: Path, timeout: float = 30.0) -> Iterator[str]:
    """torchft's lighthouse as its DiLoCo example starts it (``torchft_lighthouse
    --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``) on a free port of
    127.0.0.1, its output to ``log``; yields its address and kills it on exit.
    ``RuntimeError`` when it does not accept connections in time."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    # The console script torchft installs next to this interpreter: the lighthouse parses
    # the process's own argv, so ``python -c`` cannot start it.
    program = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if program is None:
        raise RuntimeError("torchft_lighthouse is missing: install the bench extra")
    command = [
        program,
        *("--bind", f"127.0.0.1:{port}", "--min_replicas", "1"),
        *("--quorum_tick_ms", "100", "--join_timeout_ms", "10000"),
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:

            def listening() -> bool:
                if process.poll() is not None:
                    raise RuntimeError(f"the lighthouse exited at start; see {log}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                except OSError:
                    return False
                return True

            bc.wait_for(listening, timeout, "torchft's lighthouse to listen")
            yield f"http://127.0.0.1:{port}"
        finally:
            process.kill()
            process.wait()


def run_torchft(
    size_name: str,
    seed: int,
    sync_every: int,
    scratch: Path,
    killed: bool,
    outer: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """``K`` torchft replica processes and a lighthouse process; the arm's figures. ``outer``:
    the outer Nesterov SGD's learning rate and momentum (gradientmail's default's when
    None; ``bench_text_fair`` picks them from a grid)."""
    size = SIZES[size_name]
    config = run_config(sync_every, "fp32")
    outer_lr, outer_momentum = outer or (config.outer_lr, config.outer_momentum)
    scratch.mkdir(parents=True)
    load = os.getloadavg()
    with lighthouse(scratch / "log-lighthouse.txt") as address:
        spec = _spec(
            size_name,
            seed,
            scratch / "run",
            system="torchft",
            lighthouse=address,
            sync_every=sync_every,
            fragments=FRAGMENTS,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )
        launched = bc.launch(Path(__file__).resolve(), spec, services=(), kill=_kill(size, killed))
    learners = [launched["reports"][str(k)] for k in range(K)]
    return _summary(launched, learners, size["eval_every"], spec, load) | {
        "outer": [outer_lr, outer_momentum],
        "bytes_per_learner": sum(r["allreduce_bytes"] for r in learners) / K,
        "allreduce_payload_bytes": sum(r["allreduce_payload_bytes"] for r in learners) / K,
        "syncs": [r["syncs"] for r in learners],
        "failed_syncs": [r["failed_syncs"] for r in learners],
    }


def _summary(
    launched: dict[str, Any],
    learners: list[dict[str, Any]],
    eval_every: int,
    spec: dict[str, Any],
    load: tuple[float, float, float],
) -> dict[str, Any]:
    """The figures every distributed arm shares; the final loss is the mean model's
    (``bench_text_eval.mean_model``), each learner's own loss given apart; ``load``: the
    load averages at the arm's start (``os.getloadavg()``), recorded with those at its end."""
    finals = [r["final_loss"] for r in learners]
    mean = evaluation_module.mean_model(
        Path(spec["scratch"]), len(learners), SIZES[spec["size"]], spec["seed"]
    )
    summary: dict[str, Any] = {
        "final_loss": mean["final_loss"],
        "bits_per_byte": _bits(mean["final_loss"]),
        "evaluation": "mean of the learners' models",
        "learner_spread": mean["learner_spread"],
        "bits_per_byte_by_learner": [_bits(f) for f in finals],
        "curve": bc._mean_curve([r["curve"] for r in learners]),
        "wall_seconds": launched["wall_seconds"],
        "train_seconds": sum(r["train_seconds"] for r in learners) / len(learners),
        "cpu_seconds": sum(r["cpu_seconds"] for r in learners),
        "learners": learners,
        "load": {"start": list(load), "end": list(os.getloadavg())},
    }
    if "killed" in launched["events"]:
        times = {key: launched["events"][key] for key in ("killed", "restarted")}
        summary["kill_times"] = times
        summary["failure"] = _failure(times, learners, eval_every)
    return summary


def kill_times(run: dict[str, Any]) -> dict[str, float]:
    """When a kill arm's learner was killed and restarted (``time.monotonic()``): stored
    by the run, or for a run from before they were, worked out from its restarted learner's
    first step and the seconds the run reported from its restart to it and from the kill
    to the restart."""
    if "kill_times" in run:
        return dict(run["kill_times"])
    failure = run["failure"]
    back = next(r for r in run["learners"] if r["index"] == KILLED)
    restarted = back["step_times"][0] - failure["restarted_first_step_seconds"]
    return {"killed": restarted - failure["restart_after_seconds"], "restarted": restarted}


def _failure(
    events: dict[str, float], learners: list[dict[str, Any]], eval_every: int
) -> dict[str, Any]:
    """What the kill cost: for each survivor, the longest pause between two steps after the
    kill and its time beyond its median step for the steps after the kill (both against its
    own median step time before the kill, leaving out the gaps that hold an evaluation:
    every ``eval_every`` steps, in every arm alike, up to seconds at the full size); for the
    restarted learner, seconds from its restart to its first step and to its first step on
    the group's model."""
    killed, restarted = events["killed"], events["restarted"]
    survivors = {}
    for report in learners:
        if report["index"] == KILLED:
            continue
        times = report["step_times"]
        # The gap after step n (1-based) holds the evaluation when n is a multiple of
        # eval_every.
        spans = [
            (a, b - a)
            for n, (a, b) in enumerate(itertools.pairwise(times), start=report["first_step"] + 1)
            if n % eval_every
        ]
        gaps = [g for _, g in spans]
        before = [g for a, g in spans if a < killed] or gaps
        after = [g for a, g in spans if a >= killed]
        median = sorted(before)[len(before) // 2] if before else 0.0
        survivors[str(report["index"])] = {
            "median_step_seconds": median,
            "longest_pause_after_kill": max(after, default=0.0),
            "seconds_beyond_median_after_kill": sum(max(0.0, g - median) for g in after),
            "steps_after_kill": len(after),
            "failed_syncs": report.get("failed_syncs"),
        }
    back = next(r for r in learners if r["index"] == KILLED)
    first_step = back["step_times"][0] - restarted if back["step_times"] else None
    # A gradientmail learner loads the committed model before its first step.
    on_group = back.get("group_model_at", restarted + (first_step or 0.0))
    return {
        "killed_at_step": back["first_step"],
        "restart_after_seconds": restarted - killed,
        "survivors": survivors,
        "survivors_longest_pause": max(s["longest_pause_after_kill"] for s in survivors.values()),
        "survivors_seconds_beyond_median": max(
            s["seconds_beyond_median_after_kill"] for s in survivors.values()
        ),
        "restarted_first_step_seconds": first_step,
        "restarted_on_group_model_seconds": None if on_group is None else on_group - restarted,
    }


# -- the run ----------------------------------------------------------------------------


def run_arm(
    arm: str, size_name: str, seed: int, scratch: Path, changes: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One arm by name (see ``arms``); a gradientmail arm's ``RunConfig`` with ``changes``
    (``{"overlap": None}``: unpaced)."""
    if arm in ("dp", "single"):
        return run_local(arm, {"size": size_name, "seed": seed})
    parts = arm.split("-")
    system, encoding, sync_every = parts[0], parts[1], int(parts[2].removeprefix("H"))
    killed = parts[-1] == "kill"
    where = scratch / arm
    if system == "gm":
        config = msgspec.structs.replace(run_config(sync_every, encoding), **(changes or {}))
        return run_gradientmail(size_name, seed, sync_every, encoding, where, killed, config=config)
    return run_torchft(size_name, seed, sync_every, where, killed)


def invocation(result: dict[str, Any]) -> dict[str, Any]:
    """What tells the invocation that wrote ``result`` (a results file's header) apart from
    another: when, at which commit, with which ``RunConfig.overlap``; a run's
    ``measured``."""
    return {
        "date": result["date"],
        "git_commit": result["git_commit"],
        "overlap": result["parameters"].get("overlap"),
    }


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
        arm: _failure(kill_times(result), result["learners"], size["eval_every"])
        | {"bits_per_byte": result["bits_per_byte"]}
        for arm, result in per_arm.items()
        if "failure" in result
    }
    return {"table": table, "versus_torchft": versus, "failure": failure}


_SAME = ("size", "learners", "fragments", "pattern", "lr", "steps", "batch", "model", "corpus")
"""The parameters a kept run must share with the invocation that keeps it."""


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
    differ = [key for key in _SAME if before.get(key) != parameters.get(key)]
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


def run(
    results: Path,
    size_name: str,
    only: list[str] | None,
    log: Callable[[str], None] = print,
    changes: dict[str, Any] | None = None,
    keep: bool = False,
) -> Path:
    """Every arm of the size (or ``only`` those), the gradientmail arms' ``RunConfig`` with
    ``changes``; writes ``results/text.json`` (full size) or ``results/text-{size}.json``.
    With ``keep`` the file keeps the runs of the arms this invocation does not run
    (``kept``), and every run says which invocation measured it (``measured``)."""
    size = SIZES[size_name]
    chosen = [arm for arm in arms(size) if only is None or arm in only]
    if not chosen:
        raise SystemExit(
            f"no arm of size {size_name} is named by --only {' '.join(only or [])}: "
            f"the arms are {' '.join(arms(size))}"
        )
    from gradientmail.demo.model import GPT

    corpus = data.stdlib_corpus(shards=K, seed=0)
    config = msgspec.structs.replace(run_config(size["kill_sync_every"], "fp32"), **(changes or {}))
    parameters = (
        {
            "size": size_name,
            "learners": K,
            "fragments": FRAGMENTS,
            "pattern": "contiguous",
            "outer_lr": config.outer_lr,
            "outer_momentum": config.outer_momentum,
            "lr": LR,
            "overlap": config.overlap,
            "arms": chosen,
            "harness": HARNESS,
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
    name = NAME if size_name == "full" else f"{NAME}-{size_name}"
    result = h.header(name, quick=size_name == "quick", parameters=parameters)
    measured = invocation(result)
    stored = kept(results / f"{name}.json", parameters, chosen) if keep else {}
    per_arm: dict[str, dict[str, Any]] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gm-bench-text-") as scratch:
        for arm in chosen:
            per_arm[arm] = {"measured": measured} | run_arm(
                arm, size_name, 0, Path(scratch), changes
            )
            r = per_arm[arm]
            log(
                f"  {arm}: {r['bits_per_byte']:.4f} bits/byte, {r['wall_seconds']:.0f} s"
                + (
                    f", {r['bytes_per_learner'] / 1e6:.2f} MB/learner"
                    if r.get("bytes_per_learner")
                    else ""
                )
            )
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
    if role == "syncer":
        result = bc.syncer_worker(spec)
    elif spec["system"] == "gm":
        result = bc.learner_worker(spec, int(role), learning(spec, int(role)))
    else:
        import bench_text_torchft

        result = bench_text_torchft.worker(spec, int(role))
    times = os.times()
    result["cpu_seconds"] = times.user + times.system
    out = Path(spec["scratch"]) / f"result-{role}.json"
    out.write_text(json.dumps(result), encoding="utf-8")


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


def main() -> None:
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
        "--seeds", nargs="+", type=int, help="the seeds of --mode defaults|repeat|rerun|fair"
    )
    parser.add_argument(
        "--overlap",
        type=_overlap,
        default={},
        dest="changes",
        help="RunConfig.overlap of the gradientmail arms, a number of steps or none "
        "(--mode arms; default: the default's)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the stored runs of the arms (--mode timing: the pairs) not run now in the "
        "results file (--mode arms|timing)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    if args.mode == "fair":
        import bench_text_fair

        path = bench_text_fair.run(args.results, args.size, args.only, args.seeds)
    elif args.mode == "timing":
        import bench_text_timing

        path = bench_text_timing.run(args.results, args.size, args.only, keep=args.keep)
    elif args.mode != "arms":
        import bench_text_seeds

        path = bench_text_seeds.run(args.results, args.size, args.mode, args.seeds, args.only)
    else:
        path = run(args.results, args.size, args.only, changes=args.changes, keep=args.keep)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
