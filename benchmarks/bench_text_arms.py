"""The real-text benchmark's distributed arms, one run each, and any arm by name.

``run_gradientmail``: ``K`` learner processes on a ``LocalMailbox``, one of them running the
syncer (``bench_text_task.SYNCER_IN``);
``run_torchft``: ``K`` torchft replicas and torchft's lighthouse (``lighthouse``); both
launched by ``_launch.launch`` running ``bench_text.py --worker``, both judged on the mean
of the learners' final models (``bench_text_eval.mean_model``), a kill's cost given by
``bench_text_failure``. ``run_arm`` runs one arm of ``bench_text_task.arms`` by name.
"""

import os
import shutil
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _launch
import bench_convergence_task as convergence
import bench_text_eval
import bench_text_task as task
import msgspec
from bench_text_failure import failure
from bench_text_training import run_local

WORKER_SCRIPT = Path(__file__).resolve().with_name("bench_text.py")
"""The file the worker processes run (``--worker SPEC ROLE``)."""


def worker_spec(size_name: str, seed: int, scratch: Path, **extra: Any) -> dict[str, Any]:
    """The spec a run's worker processes read: the size, seed, steps, ``K`` learners and
    scratch directory, the size's pacing, and ``extra``."""
    return (
        {
            "size": size_name,
            "seed": seed,
            "steps": task.SIZES[size_name]["steps"],
            "learners": task.learners(size_name),
            "scratch": str(scratch),
        }
        | task.SIZES[size_name].get("pacing", {})
        | extra
    )


def _kill(size: dict[str, Any], killed: bool) -> _launch.Kill | None:
    if not killed:
        return None
    return _launch.Kill(task.KILLED, int(size["steps"] * task.KILL_AT), size["restart_after"])


def run_gradientmail(
    size_name: str,
    seed: int,
    sync_every: int,
    encoding: str,
    scratch: Path,
    killed: bool,
    **setup: Any,
) -> dict[str, Any]:
    """``K`` learner processes on a directory, learner ``SYNCER_IN``'s running the syncer
    (its CPU counted in that learner's); the arm's figures. ``setup``
    may name ``config`` (a whole ``RunConfig``, instead of ``run_config(sync_every,
    encoding)``), ``learners`` (instead of ``K``) and ``inner`` (the inner optimizer)."""
    size = task.SIZES[size_name]
    config = setup.get("config") or task.run_config(sync_every, encoding)
    learners_count = setup.get("learners", task.learners(size_name))
    spec = worker_spec(
        size_name,
        seed,
        scratch,
        system="gm",
        config=msgspec.structs.asdict(config),
        learners=learners_count,
        inner=setup.get("inner", "adamw"),
        syncer_in=task.SYNCER_IN,
    )
    load = os.getloadavg()
    launched = _launch.launch(WORKER_SCRIPT, spec, services=(), kill=_kill(size, killed))
    learners = [launched["reports"][str(k)] for k in range(learners_count)]
    syncer = launched["reports"]["syncer"]
    rounds = syncer["rounds"]
    lags = [lag for r in learners for lag in r["lag_steps"]]
    summary = _summary(launched, learners, size["eval_every"], spec, load)
    return summary | {
        "bytes_per_learner": sum(r["bytes_up"] + r["bytes_down"] for r in learners)
        / learners_count,
        "syncer_bytes": syncer["bytes_up"] + syncer["bytes_down"],
        "syncer_bytes_by_kind": syncer["bytes_by_kind"],
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

            _launch.wait_for(listening, timeout, "torchft's lighthouse to listen")
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
    size = task.SIZES[size_name]
    config = task.run_config(sync_every, "fp32")
    outer_lr, outer_momentum = outer or (config.outer_lr, config.outer_momentum)
    scratch.mkdir(parents=True)
    load = os.getloadavg()
    with lighthouse(scratch / "log-lighthouse.txt") as address:
        spec = worker_spec(
            size_name,
            seed,
            scratch / "run",
            system="torchft",
            lighthouse=address,
            sync_every=sync_every,
            fragments=task.FRAGMENTS,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )
        launched = _launch.launch(WORKER_SCRIPT, spec, services=(), kill=_kill(size, killed))
    n = spec["learners"]
    learners = [launched["reports"][str(k)] for k in range(n)]
    return _summary(launched, learners, size["eval_every"], spec, load) | {
        "outer": [outer_lr, outer_momentum],
        "bytes_per_learner": sum(r["allreduce_bytes"] for r in learners) / n,
        "allreduce_payload_bytes": sum(r["allreduce_payload_bytes"] for r in learners) / n,
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
    mean = bench_text_eval.mean_model(
        Path(spec["scratch"]), len(learners), task.SIZES[spec["size"]], spec["seed"]
    )
    summary: dict[str, Any] = {
        "final_loss": mean["final_loss"],
        "bits_per_byte": task.bits(mean["final_loss"]),
        "evaluation": "mean of the learners' models",
        "learner_spread": mean["learner_spread"],
        "bits_per_byte_by_learner": [task.bits(f) for f in finals],
        "curve": convergence.mean_curve([r["curve"] for r in learners]),
        "wall_seconds": launched["wall_seconds"],
        "train_seconds": sum(r["train_seconds"] for r in learners) / len(learners),
        "cpu_seconds": sum(r["cpu_seconds"] for r in learners),
        "learners": learners,
        "load": {"start": list(load), "end": list(os.getloadavg())},
    }
    if "killed" in launched["events"]:
        times = {key: launched["events"][key] for key in ("killed", "restarted")}
        summary["kill_times"] = times
        summary["failure"] = failure(times, learners, eval_every)
    return summary


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
        config = task.run_config(sync_every, encoding, **(changes or {}))
        return run_gradientmail(size_name, seed, sync_every, encoding, where, killed, config=config)
    return run_torchft(size_name, seed, sync_every, where, killed)
