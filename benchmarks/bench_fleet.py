"""Fleets of unequal machines on real text: does every learner train at its own speed, and
does the run learn more for it?

The real-text task of ``bench_text.py`` (the standard library's source, the byte GPT of its
``medium`` size, AdamW, ``K = 4`` learners, ``F = 5`` fragments, H 50 unless the fleet names
another). Every learner gets the same wall-clock budget. A learner of speed ``s`` takes
``s × BASE_STEP`` seconds a step: its compute, then a sleep up to that time (slowness made by
sleep, so that a slow learner does not take the fast ones' cores on this 2-core machine; a
step whose compute alone is longer is not padded). The learning rate follows
``bench_convergence_task.lr_at`` over the fraction of the budget elapsed, so a slow learner
is not left at a high rate; in ``equal-steps`` (1/1/1/1, H 50) over the fraction of the
steps each learner takes alone in the budget instead (``bench_fleet_task.by_steps``), so
that the rates do not depend on the timing: two systems that compute the same model step
for step (the synchronous mode and torchft's DiLoCo) end on it there, and what separates an
arm from them is its algorithm, not the chaos of millisecond differences in its rates.

Fleets: ``equal`` (1/1/1/1), ``mixed`` (1/1.5/2/3), ``straggler`` (1/1/1/4) and ``pausing``
(1/1/1/1, learner 3 pausing ``PAUSE`` seconds every ``PAUSE_EVERY`` steps, a validation pass
as a user's trainer makes one); ``equal-H100`` and ``equal-H250``, the equal fleet at H 100
and 250 (``sync_every``); ``mixed-matched``, ``straggler-matched`` and ``pausing-matched``,
equal fleets that take as many steps in the budget as those (``matched``): the reference an
unequal fleet is held to. Arms: ``gm`` (the default, ``RunConfig.overlap`` None: the
adaptive schedule), ``gm-repeatable`` (``overlap=2``: the rounds pace every learner),
``gm-sync`` (``overlap=0``, the synchronous mode: what torchft's DiLoCo computes),
``dp`` (data-parallel, one process, every learner's batch per step at the fastest speed),
and ``torchft`` (its DiLoCo, ``bench_text_torchft``'s replicas with the same speeds:
synchronous, every sync waits for the slowest).

Per arm: steps per learner (local, and committed: the sum of its steps over the rounds of
a fragment, averaged over fragments, against what it would take alone in the budget, its
pauses included), the mean of the learners' own models' bits per byte when their budget
ended (before their close), that of the mean of those models (gradientmail's close ends
on it: its final round commits the mean of the models closing began with), that of the
newest committed θ then (the model the final rounds start from: ``bench_fleet_close``),
what each would do alone in the budget (``budget / (s × BASE_STEP)``), each learner's share
of its training time spent waiting on rounds (``NodeState.waited_seconds``), the final bits
per byte of the shared model (gradientmail: the newest committed model once every learner
closed; torchft: the mean of its replicas' models after their last sync,
``bench_text_eval.mean_model``, as ``bench_text``'s fair harness judges it, the mean of
their losses recorded apart) and the learners' bits per byte against wall time (every
``CURVE_EVERY`` seconds, on the final evaluation's windows).

Usage: ``.venv/bin/python benchmarks/bench_fleet.py [--fleets NAME ...] [--arms NAME ...]
[--repeats N] [--seeds S ...] [--budget SECONDS] [--keep]`` (``--repeats``: runs of each
seed, 3 by default; ``--seeds``: 0 by default; ``--keep``: the stored runs of the fleets,
arms and seeds not run now stay in ``fleet.json``).
"""

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_fleet_close as close
import bench_fleet_task as fleet_task
import bench_text_data as data
import bench_text_eval
import bench_text_task as task
import msgspec
from _launch import launch
from _workers import Learning, learner_worker, syncer_worker
from bench_text_arms import lighthouse, worker_spec

NAME = "fleet"
ARMS = ("gm", "gm-repeatable", "gm-sync", "torchft", "dp")
EVALUATION = "mean of the replicas' models"
"""How a torchft run's final bits per byte were measured (a run without it: the mean of its
replicas' losses, which the page does not judge)."""


def config(arm: str, fleet: str) -> Any:
    overlap = {"gm-repeatable": 2, "gm-sync": 0}.get(arm)
    return task.run_config(fleet_task.sync_every(fleet), "fp32", overlap=overlap)


def learning(spec: dict[str, Any], index: int) -> Learning:
    """Learner ``index`` of the fleet in ``spec``: the real-text model and batches of
    ``bench_text``, trained for the budget at its speed."""
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    size = task.SIZES[fleet_task.SIZE]
    corpus = data.stdlib_corpus(shards=spec["learners"], seed=spec["seed"])
    length = size["model"]["context"]
    final_set = corpus.evaluation(*size["final_eval"], length=length)
    model = GPT(task.model_config(size), seed=spec["seed"])
    optimizer, lr = task.inner_optimizer("adamw", model)
    batches = corpus.train(index, batch_size=size["batch"], length=length)
    speed = spec["speeds"][index]
    pauses = spec["fleet"] == "pausing" and index == len(spec["speeds"]) - 1

    def run(first: int, after_step: Callable[[], None]) -> list[list[float]]:
        started = time.monotonic()  # every learner starts once all have joined
        rate = _rates(spec["fleet"], speed, spec["budget"], pauses, started)

        def step() -> None:
            scale = rate()
            for group in optimizer.param_groups:
                group["lr"] = lr * scale
            loss = model.loss(next(batches))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        _, overrun, curve = fleet_task.timed_steps(
            step,
            speed=speed,
            budget=spec["budget"],
            started=started,
            pauses=pauses,
            after_step=after_step,
            probe=lambda: evaluate(model, final_set),
        )
        (Path(spec["scratch"]) / f"overrun-{index}").write_text(str(overrun))
        before = evaluate(model, final_set)
        (Path(spec["scratch"]) / f"before-{index}").write_text(str(before))
        if spec["system"] == "gm":
            bench_text_eval.save(model, _before_close(Path(spec["scratch"])), index)
            close.committed_reading(spec, index, model, lambda m: evaluate(m, final_set))
        return curve

    def final() -> float:
        if spec["system"] == "torchft":
            bench_text_eval.save(model, Path(spec["scratch"]), index)
        return evaluate(model, final_set)

    return Learning(model, size["batch"] * length, run, final, optimizer)


def _rates(
    fleet: str, speed: float, budget: float, pauses: bool, started: float
) -> Callable[[], float]:
    """The learning rate's factor for each next step of a learner of ``fleet`` at ``speed``
    that started at ``started``: the clock's share of the budget, or for a fleet whose rate
    follows the steps (``by_steps``) the share of what it takes alone that it has taken."""
    if not fleet_task.by_steps(fleet):
        return lambda: fleet_task.lr_scale(started, budget)
    alone = fleet_task.alone_steps(speed, budget, pauses=pauses)
    taken = itertools.count()
    return lambda: fleet_task.step_scale(next(taken), alone)


def _before_close(scratch: Path) -> Path:
    """Where the learners of the run in ``scratch`` save their models when their budget
    ends."""
    folder = scratch / "before-close"
    folder.mkdir(exist_ok=True)
    return folder


def run_dp(fleet: str, seed: int, budget: float) -> dict[str, Any]:
    """Data-parallel at the fastest speed: every learner's batch in one step, for the
    budget."""
    import torch

    from gradientmail.demo.data import evaluate
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    size = task.SIZES[fleet_task.SIZE]
    learners = len(fleet_task.FLEETS[fleet])
    corpus = data.stdlib_corpus(shards=learners, seed=seed)
    length = size["model"]["context"]
    streams = [corpus.train(k, batch_size=size["batch"], length=length) for k in range(learners)]
    model = GPT(task.model_config(size), seed=seed)
    optimizer, lr = task.inner_optimizer("adamw", model)
    started = time.monotonic()
    rate = _rates(fleet, 1.0, budget, False, started)

    def step() -> None:
        scale = rate()
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        loss = model.loss(torch.cat([next(s) for s in streams]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    final_set = corpus.evaluation(*size["final_eval"], length=length)
    steps, _, curve = fleet_task.timed_steps(
        step,
        speed=1.0,
        budget=budget,
        started=started,
        pauses=False,
        after_step=lambda: None,
        probe=lambda: evaluate(model, final_set),
    )
    final = evaluate(model, final_set)
    curve.append([budget, final])
    return {
        "bits_per_byte": task.bits(final),
        "steps": steps,
        "wall_seconds": budget,
        "curve": _bits_curve(curve),
    }


def _bits_curve(curve: list[list[float]]) -> list[list[float]]:
    return [[t, task.bits(loss)] for t, loss in curve]


def fleet_curve(reports: list[dict[str, Any]], budget: float, final: float) -> list[list[float]]:
    """The learners' validation loss against the seconds of the budget, averaged over
    learners: their own models while they train, then ``final`` (the final model's, after
    their close) at the budget's end."""
    trained = mean_curve([r["curve"][:-1] for r in reports])
    return [*trained, [budget, final]]


def mean_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """The learners' curves averaged point by point (the shortest one's points)."""
    length = min(len(c) for c in curves)
    return [
        [statistics.fmean(c[i][0] for c in curves), statistics.fmean(c[i][1] for c in curves)]
        for i in range(length)
    ]


def committed_steps(rounds: list[dict[str, Any]], fragments: int) -> dict[str, float]:
    """Each learner's steps that reached a committed round, averaged over fragments."""
    totals: dict[str, float] = {}
    for r in rounds:
        for learner, steps in r["steps"].items():
            totals[learner] = totals.get(learner, 0.0) + steps / fragments
    return totals


def run_gm(arm: str, fleet: str, seed: int, budget: float, scratch: Path) -> dict[str, Any]:
    """One gradientmail arm: ``K`` learner processes and a syncer; the fleet's figures."""
    speeds = fleet_task.FLEETS[fleet]
    spec = worker_spec(
        fleet_task.SIZE,
        seed,
        scratch,
        system="gm",
        config=msgspec.structs.asdict(config(arm, fleet)),
        learners=len(speeds),
        speeds=speeds,
        fleet=fleet,
        budget=budget,
    )
    launched = launch(Path(__file__).resolve(), spec)
    reports = [launched["reports"][str(k)] for k in range(len(speeds))]
    committed = committed_steps(launched["reports"]["syncer"]["rounds"], task.FRAGMENTS)
    learners = []
    for k, (report, speed) in enumerate(zip(reports, speeds, strict=True)):
        alone = fleet_task.alone_steps(
            speed, budget, pauses=fleet == "pausing" and k == len(speeds) - 1
        )
        learners.append(
            {
                "speed": speed,
                "steps": len(report["step_times"]),
                "committed_steps": committed.get(f"learner-{k}", 0.0),
                "alone_steps": alone,
                "waiting_share": report["waited_seconds"] / max(report["train_seconds"], 1e-9),
                "close_seconds": report["seconds_with_flush"] - report["train_seconds"],
            }
        )
    finals = [r["final_loss"] for r in reports]
    before = [float((scratch / f"before-{k}").read_text()) for k in range(len(speeds))]
    shared = close.shared_loss(scratch, fleet_task.SIZE, seed, len(speeds))
    curve = fleet_curve(reports, budget, shared)
    rounds = launched["reports"]["syncer"]["rounds"]
    committed_loss = close.before_final(scratch, len(speeds), rounds)
    lags = [lag for r in reports for lag in r["lag_steps"]]
    fastest = min(range(len(speeds)), key=lambda k: speeds[k])
    before_close = bench_text_eval.mean_model(
        _before_close(scratch), len(speeds), task.SIZES[fleet_task.SIZE], seed
    )
    return {
        "bits_per_byte": task.bits(shared),
        "bits_per_byte_mean_model_before_close": task.bits(before_close["final_loss"]),
        "bits_per_byte_learners_after_close": task.bits(sum(finals) / len(finals)),
        "bits_per_byte_before_close": task.bits(sum(before) / len(before)),
        "bits_per_byte_committed": None if committed_loss is None else task.bits(committed_loss),
        "curve": _bits_curve(curve),
        "learners": learners,
        "fastest_waiting_share": learners[fastest]["waiting_share"],
        "committed_over_alone": sum(x["committed_steps"] for x in learners)
        / sum(x["alone_steps"] for x in learners),
        "rounds": len(rounds),
        "mean_participants": sum(r["participants"] for r in rounds) / max(1, len(rounds)),
        "lag_steps_median": statistics.median(lags) if lags else None,
        "wall_seconds": launched["wall_seconds"],
    }


def run(
    fleets: list[str],
    arms: list[str],
    repeats: int,
    budget: float,
    results: Path,
    keep: bool,
    seeds: list[int],
) -> Path:
    """Every fleet × arm × seed × repeat (a seed run again: the timing differs; data-parallel
    once a seed), written to ``results/fleet.json`` after each, every run marked with its
    seed and the invocation that measured it (``measured``: date, commit); with ``keep`` the
    stored runs of the fleets, arms and seeds not run now stay (a matrix measured in parts,
    or more seeds of an arm; ``SystemExit`` when their budget or sizes differ)."""
    result = h.header(
        NAME,
        quick=budget < fleet_task.BUDGET,
        parameters={
            "size": fleet_task.SIZE,
            "base_step": fleet_task.BASE_STEP,
            "sync_every": fleet_task.SYNC_EVERY,
            "budget": budget,
            "pause": [fleet_task.PAUSE, fleet_task.PAUSE_EVERY],
            "fleets": {f: fleet_task.FLEETS[f] for f in fleets},
            "arms": arms,
            "repeats": repeats,
            "seeds": seeds,
        },
    )
    runs = _stored(results / f"{NAME}.json", result, fleets) if keep else {}
    measured = {"date": result["date"], "git_commit": result["git_commit"]}
    for fleet in fleets:
        for arm in arms:
            key = f"{fleet}/{arm}"
            runs[key] = [r for r in runs.get(key, []) if r.get("seed") not in seeds]
            for seed in seeds:
                for repeat in range(repeats if arm != "dp" else 1):
                    figures = _one(arm, fleet, seed, budget)
                    figures |= {"seed": seed, "load": os.getloadavg(), "measured": measured}
                    runs[key].append(figures)
                    brief = json.dumps(_brief(figures))
                    print(f"{fleet}/{arm} seed {seed} #{repeat}: {brief}", flush=True)
                    result["figures"] = {"runs": runs}
                    h.write_result(results, NAME, result)
    return results / f"{NAME}.json"


def _stored(
    stored: Path, result: dict[str, Any], fleets: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """The runs already in ``stored`` (none when there is no such file), each marked with the
    invocation that measured it; ``result``'s fleets gain theirs."""
    if not stored.exists():
        return {}
    before = json.loads(stored.read_text(encoding="utf-8"))
    same = ("size", "base_step", "sync_every", "budget", "pause")
    if any(before["parameters"][k] != result["parameters"][k] for k in same):
        raise SystemExit(f"{stored}: its runs were measured with other parameters")
    runs: dict[str, list[dict[str, Any]]] = before["figures"]["runs"]
    earlier = {"date": before["date"], "git_commit": before["git_commit"]}
    for entries in runs.values():
        for entry in entries:
            entry.setdefault("measured", earlier)
    result["parameters"]["fleets"] = before["parameters"]["fleets"] | {
        f: fleet_task.FLEETS[f] for f in fleets
    }
    return runs


def _one(arm: str, fleet: str, seed: int, budget: float) -> dict[str, Any]:
    """One run of ``arm`` on ``fleet``: its figures."""
    if arm == "dp":
        return run_dp(fleet, seed, budget)
    with tempfile.TemporaryDirectory(prefix="gm-fleet-") as tmp:
        if arm == "torchft":
            return run_torchft(fleet, seed, budget, Path(tmp) / "torchft")
        return run_gm(arm, fleet, seed, budget, Path(tmp) / "run")


def _brief(figures: dict[str, Any]) -> dict[str, Any]:
    keys = [
        "bits_per_byte",
        "bits_per_byte_mean_model_before_close",
        "bits_per_byte_before_close",
        "bits_per_byte_committed",
        "bits_per_byte_mean_of_losses",
        "fastest_waiting_share",
        "committed_over_alone",
        "rounds",
    ]
    return {k: round(figures[k], 4) for k in keys if k in figures}


def run_torchft(fleet: str, seed: int, budget: float, scratch: Path) -> dict[str, Any]:
    """torchft's DiLoCo with the fleet's speeds: one replica process per learner and a
    lighthouse; its figures (waiting: the share of its budget a learner's steps overran
    their time, blocked in a sync)."""
    speeds = fleet_task.FLEETS[fleet]
    base = config("gm", fleet)
    scratch.mkdir(parents=True)
    with lighthouse(scratch / "log-lighthouse.txt") as address:
        spec = worker_spec(
            fleet_task.SIZE,
            seed,
            scratch / "run",
            system="torchft",
            lighthouse=address,
            sync_every=base.sync_every,
            fragments=task.FRAGMENTS,
            outer_lr=base.outer_lr,
            outer_momentum=base.outer_momentum,
            learners=len(speeds),
            speeds=speeds,
            fleet=fleet,
            budget=budget,
        )
        launched = launch(Path(__file__).resolve(), spec, services=())
    reports = [launched["reports"][str(k)] for k in range(len(speeds))]
    learners = []
    for k, (report, speed) in enumerate(zip(reports, speeds, strict=True)):
        overrun = float((scratch / "run" / f"overrun-{k}").read_text())
        learners.append(
            {
                "speed": speed,
                "steps": len(report["step_times"]),
                "alone_steps": fleet_task.alone_steps(
                    speed, budget, pauses=fleet == "pausing" and k == len(speeds) - 1
                ),
                "waiting_share": overrun / budget,
                "syncs": report["syncs"],
                "failed_syncs": report["failed_syncs"],
            }
        )
    fastest = min(range(len(speeds)), key=lambda k: speeds[k])
    mean = bench_text_eval.mean_model(
        scratch / "run", len(speeds), task.SIZES[fleet_task.SIZE], seed
    )
    curve = fleet_curve(reports, budget, mean["final_loss"])
    return {
        "bits_per_byte": task.bits(mean["final_loss"]),
        "evaluation": EVALUATION,
        "bits_per_byte_mean_of_losses": task.bits(
            statistics.fmean(r["final_loss"] for r in reports)
        ),
        "curve": _bits_curve(curve),
        "learners": learners,
        "fastest_waiting_share": learners[fastest]["waiting_share"],
        "wall_seconds": launched["wall_seconds"],
    }


def _worker(spec_path: Path, role: str) -> None:
    spec = json.loads(spec_path.read_text())
    if role == "syncer":
        report = syncer_worker(spec)
    elif spec["system"] == "torchft":
        import bench_text_torchft

        report = bench_text_torchft.worker(spec, int(role), learning(spec, int(role)))
    else:
        report = learner_worker(spec, int(role), learning(spec, int(role)))
    (Path(spec["scratch"]) / f"result-{role}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fleets", nargs="+", choices=list(fleet_task.FLEETS), default=list(fleet_task.FLEETS)
    )
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--budget", type=float, default=fleet_task.BUDGET)
    parser.add_argument("--results", type=Path, default=h.RESULTS)
    parser.add_argument(
        "--keep", action="store_true", help="keep the stored runs of other fleets, arms, seeds"
    )
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    arguments = (args.fleets, args.arms, args.repeats, args.budget, args.results, args.keep)
    print(run(*arguments, args.seeds))


if __name__ == "__main__":
    main()
