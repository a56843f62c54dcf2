"""One lying insider among honest learners, on the convergence benchmark's task.

The insider holds the run key (the run here is unsigned, so every learner does): it trains
like the others, but every snapshot it publishes claims ``max_tokens_per_step`` tokens per
step and carries a crafted delta instead of its own, in a chosen direction, as large as the
run accepts: among 3 or more learners just under the median test (``GAIN`` times its own
honest delta's norm, a proxy for the round's median), among 2 just under
``MAX_DELTA_RATIO × (‖θ‖ + √n)``. Directions: ``flip``, its own delta reversed (against
the fleet's progress); ``fixed``, one random unit direction per fragment, every round.

For each fleet size (4 and 2 learners) and each aggregation (``robust``: with
``RunConfig.robust``; ``default``: without it, the control; ``screened``: ``robust`` and a
syncer with ``NodeOptions.trusted_loss``, the task's model on two fixed batches of a shard no
learner trains on, the operator's own evaluation) it runs the honest fleet and each
attack, on each of ``SEEDS`` (the same seeds and data for every arm; the default's attacks,
which diverge, on the first seed only), one dedicated syncer each (``_launch.launch``), in
the repeatable mode (``OVERLAP``: every learner in every round at the same steps, so two
runs of one arm give the same losses and two aggregations differ by the rule alone). It
reports the honest learners' mean final loss, its change over that aggregation's honest run
of the same seed and over the robust honest run (a fleet of honest learners), and robust's
and the screen's cost on an honest run (over the default's on the same seed), each as the
median over the seeds.

Usage: ``.venv/bin/python benchmarks/bench_insider.py [--steps N] [--seeds 0 1 2]
[--fleets 4 2] [--modes robust default screened] [--attacks flip fixed] [--adaptive] [--out FILE]``
(``--adaptive``: the default schedule instead, whose rounds depend on timing); the learner
and syncer processes run this file with ``--worker``. Its figures: benchmarks/results/
insider.json, quoted in docs/reliability.md (the threat table) and docs/protocol.md
("Aggregation").
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench_convergence_task as task
import msgspec
from _launch import launch
from _workers import learner_worker, syncer_worker

GAIN = 4.75
"""The insider's norm over its own honest norm among 3 or more: 0.95 × the default
``outlier_factor``."""
ATTACKS = ("flip", "fixed")
STEPS = 40
"""Steps per learner."""
SEEDS = (0, 1, 2)
"""The seeds every arm runs on (the same for every arm)."""
OVERLAP = 2
"""The repeatable mode (``RunConfig.repeatable``): every learner in every round, at the same
steps, so two runs of one arm on one seed differ only by the aggregation."""
MODES = ("robust", "default", "screened")
TRUSTED_SHARD = 1000
"""The shard of the task's language the screened mode's trusted loss scores (learners train
on shards ``0 .. K - 1``; the final evaluation is the task's own held-out set)."""
TRUSTED_BATCHES = 2
"""Batches of ``EVAL_BATCH_SIZE`` sequences in the trusted loss: one fixed set, every call."""


def _trusted_loss(spec: dict[str, Any]) -> Any:
    """The operator's trusted loss (``NodeOptions.trusted_loss``) of the screened mode: the
    task's model on ``TRUSTED_BATCHES`` batches of ``TRUSTED_SHARD``."""
    import torch

    from gradientmail.demo.data import evaluate, synthetic
    from gradientmail.demo.model import GPT

    torch.set_num_threads(1)
    corpus = synthetic(length=task.CONTEXT, seed=spec["seed"])
    stream = corpus.train(TRUSTED_SHARD, batch_size=task.EVAL_BATCH_SIZE, length=task.CONTEXT)
    batches = [next(stream) for _ in range(TRUSTED_BATCHES)]
    model = GPT(task.model_config(), seed=spec["seed"])
    params = dict(model.named_parameters())

    def loss(state: Any) -> float:
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        return evaluate(model, batches)

    return loss


def _install_attack(spec: dict[str, Any]) -> None:
    """Make this process's learner publish crafted deltas (``spec["attack"]``)."""
    import math

    import torch

    from gradientmail._node import publisher
    from gradientmail.protocol.aggregation import MAX_DELTA_RATIO
    from gradientmail.protocol.codec import encode_fragment

    mode, fleet = spec["attack"], spec["learners"]

    def crafted(
        job: Any, fragment_spec: Any, encoding: str, block_size: int, version: int
    ) -> tuple[bytes, float | None]:
        p = job.publish
        honest = [s.float() - b.float() for s, b in zip(p.snapshot, p.base, strict=True)]
        own = math.sqrt(sum(float(t.double().pow(2).sum()) for t in honest))
        if mode == "flip":
            direction = [-t for t in honest]
        else:
            generator = torch.Generator().manual_seed(1000 + p.fragment)
            direction = [torch.randn(t.shape, generator=generator) for t in honest]
        length = math.sqrt(sum(float(t.double().pow(2).sum()) for t in direction)) or 1.0
        if fleet >= 3:
            target = GAIN * own
        else:
            base = math.sqrt(sum(float(b.double().pow(2).sum()) for b in p.base))
            numel = sum(b.numel() for b in p.base)
            target = 0.95 * MAX_DELTA_RATIO * (base + math.sqrt(numel))
        delta = [t * (target / length) for t in direction]
        data = encode_fragment(
            delta, fragment_spec, encoding, block_size=block_size, version=version
        )
        return data, own

    publisher.encode_delta = crafted  # type: ignore[assignment]


def _worker(spec_path: Path, role: str) -> None:
    spec = json.loads(spec_path.read_text())
    if role == "syncer":
        screened = spec["mode"] == "screened"
        result = syncer_worker(spec, _trusted_loss(spec) if screened else None)
    else:
        index = int(role)
        learning = task.synthetic_learning(spec, index)
        if spec["attack"] is not None and index == spec["insider"]:
            _install_attack(spec)
            learning.tokens_per_step = spec["config"]["max_tokens_per_step"]
        result = learner_worker(spec, index, learning)
    (Path(spec["scratch"]) / f"result-{role}.json").write_text(json.dumps(result))


BOUNDS = {"capped": "weighted for ", "faded": "round's center", "clipped": " clipped to "}
"""What each kind of bound writes in ``Participant.bounded``: a capped weight, a delta faded
by centered clipping, a clipped norm (rounds of one or two)."""


def _bounded(store: Path, insider: str | None) -> dict[str, int]:
    """How many honest and insider participations the run's records hold, how many of each
    a bound touched (``Participant.bounded``), and how many each kind (``BOUNDS``) touched;
    ``weight_zero``: those that weigh nothing."""
    import anyio

    from gradientmail.mailbox import LocalMailbox
    from gradientmail.store import Store

    async def count() -> dict[str, int]:
        counts: dict[str, int] = {}
        async with LocalMailbox(store) as mailbox:
            reader = Store(mailbox, unverified=True)
            for round in await reader.record_rounds():
                record = await reader.record(round)
                for p in record.participants if record is not None else ():
                    who = "insider" if p.learner == insider else "honest"
                    note = getattr(p, "bounded", None)
                    note = note if isinstance(note, str) else ""
                    kinds = [kind for kind, mark in BOUNDS.items() if mark in note]
                    for key in (who, *(f"{who}_{k}" for k in kinds)):
                        counts[key] = counts.get(key, 0) + 1
                    if note:
                        counts[f"{who}_bounded"] = counts.get(f"{who}_bounded", 0) + 1
                    if p.weight == 0.0:
                        counts[f"{who}_weight_zero"] = counts.get(f"{who}_weight_zero", 0) + 1
        return counts

    return anyio.run(count)


def run_arm(
    learners: int,
    attack: str | None,
    mode: str,
    seed: int,
    steps: int,
    scratch: Path,
    *,
    adaptive: bool = False,
) -> dict[str, Any]:
    """One fleet of ``learners`` (the last one the insider when ``attack``) in ``mode``
    (``MODES``), on ``seed``, in the repeatable mode (``adaptive``: the default schedule):
    the honest learners' final losses, and what the syncer's rounds recorded."""
    settings = task.plan(quick=True)
    config = task.run_config(settings["sync_every"][0], settings["encodings"][0])
    overlap = None if adaptive else OVERLAP
    config = msgspec.structs.replace(config, robust=mode != "default", overlap=overlap)
    insider = learners - 1
    spec = {
        "seed": seed,
        "steps": steps,
        "eval_every": steps,
        "learners": learners,
        "config": msgspec.structs.asdict(config),
        "scratch": str(scratch),
        "attack": attack,
        "insider": insider,
        "mode": mode,
    }
    launched = launch(Path(__file__).resolve(), spec)
    reports = launched["reports"]
    honest = [reports[str(k)]["final_loss"] for k in range(learners) if k != insider]
    rounds = reports["syncer"]["rounds"]
    insider_name = f"learner-{insider}" if attack is not None else None
    return {
        "participations": _bounded(scratch / "store", insider_name),
        "honest_final_loss": sum(honest) / len(honest),
        "honest_final_losses": honest,
        "insider_final_loss": reports[str(insider)]["final_loss"],
        "rounds": len(rounds),
        "rejected": sum(len(r["rejected"]) for r in rounds),
        "screened": _screened(rounds, insider_name),
        "wall_seconds": launched["wall_seconds"],
    }


def _screened(rounds: list[dict[str, Any]], insider: str | None) -> dict[str, int]:
    """How many of the honest learners' and the insider's snapshots the trusted loss
    rejected (``loss``)."""
    counts = {"honest": 0, "insider": 0}
    for round in rounds:
        for learner, reason in round["rejected_by"]:
            if reason == "loss":
                counts["insider" if learner == insider else "honest"] += 1
    return counts


def arms(fleets: list[int], modes: list[str], attacks: list[str], seeds: list[int]) -> list[str]:
    """The arms' names, ``fleet-mode-attack-seed``: every fleet, mode and attack on every
    seed, but the attacks without ``robust`` (the control, which diverges) on the first."""
    names = []
    for seed in seeds:
        for learners in fleets:
            for mode in modes:
                for attack in ("honest", *attacks):
                    if mode == "default" and attack != "honest" and seed != seeds[0]:
                        continue
                    names.append(f"{learners}-{mode}-{attack}-{seed}")
    return names


def _change(figures: dict[str, Any], name: str, reference: str) -> float | None:
    """The honest learners' final loss of arm ``name`` over ``reference``'s, in percent."""
    if reference not in figures:
        return None
    base = figures[reference]["honest_final_loss"]
    return float(100 * (figures[name]["honest_final_loss"] - base) / base)


def compare(figures: dict[str, Any]) -> None:
    """Adds to each arm its ``change_percent`` over the same seed's honest run of its mode,
    and to each robust honest run its ``cost_percent`` over the same seed's default one."""
    for name, arm in figures.items():
        learners, mode, attack, seed = name.split("-")
        arm["change_percent"] = _change(figures, name, f"{learners}-{mode}-honest-{seed}")
        if attack != "honest":
            arm["over_honest_percent"] = _change(figures, name, f"{learners}-robust-honest-{seed}")
        if mode != "default" and attack == "honest":
            arm["cost_percent"] = _change(figures, name, f"{learners}-default-honest-{seed}")


def summary(figures: dict[str, Any]) -> dict[str, Any]:
    """Per fleet, mode and attack, the median over the seeds of: the change of the honest
    learners' final loss over the same seed's honest run of that mode (``change``); for an
    attack, over the same seed's robust honest run (``over_honest``: what the insider costs
    a fleet of honest learners under ``robust``); for a robust or screened honest run, over
    the same seed's default honest run (``cost``)."""
    groups: dict[str, dict[str, list[float]]] = {}
    for name, arm in figures.items():
        learners, mode, attack, _ = name.split("-")
        group = groups.setdefault(
            f"{learners}-{mode}-{attack}", {"change": [], "over_honest": [], "cost": []}
        )
        for kind, key in (
            ("change", "change_percent"),
            ("over_honest", "over_honest_percent"),
            ("cost", "cost_percent"),
        ):
            if arm.get(key) is not None:
                group[kind].append(arm[key])
    return {
        key: {
            kind: {"median": statistics.median(values), "values": values}
            for kind, values in group.items()
            if values
        }
        for key, group in groups.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per learner")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--fleets", nargs="+", type=int, default=[4, 2])
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes")
    parser.add_argument(
        "--adaptive", action="store_true", help="the default schedule (timing-dependent)"
    )
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gm-bench-insider-") as scratch:
        for name in arms(args.fleets, args.modes, args.attacks, args.seeds):
            learners, mode, attack, seed = name.split("-")
            figures[name] = arm = run_arm(
                int(learners),
                None if attack == "honest" else attack,
                mode,
                int(seed),
                args.steps,
                Path(scratch) / name,
                adaptive=args.adaptive,
            )
            print(
                f"{name:22} honest learners' loss {arm['honest_final_loss']:.6g}, "
                f"{arm['rounds']} rounds, {arm['rejected']} rejected, "
                f"{arm['wall_seconds']:.0f} s, participations {arm['participations']}",
                flush=True,
            )
    compare(figures)
    result = {
        "steps": args.steps,
        "seeds": args.seeds,
        "schedule": "adaptive" if args.adaptive else f"repeatable, overlap {OVERLAP}",
        "arms": figures,
    }
    result["summary"] = summary(figures)
    print(json.dumps(result["summary"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
