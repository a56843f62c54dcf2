"""One lying insider among honest learners, on the convergence benchmark's task.

The insider holds the run key (the run here is unsigned, so every learner does): it trains
like the others, but every snapshot it publishes claims ``max_tokens_per_step`` tokens per
step and carries a crafted delta instead of its own, in a chosen direction, as large as the
run accepts: among 3 or more learners just under the median test (``GAIN`` times its own
honest delta's norm, a proxy for the round's median), among 2 just under
``MAX_DELTA_RATIO × (‖θ‖ + √n)``. Directions: ``flip``, its own delta reversed (against
the fleet's progress); ``fixed``, one random unit direction per fragment, every round.

For each fleet size (4 and 2 learners) and each aggregation (``robust``: with
``RunConfig.robust``; ``default``: without it, the control) it runs the honest fleet and each
attack on the same seed and data, one dedicated syncer each (``_launch.launch``),
and reports the honest learners' mean final loss and its change over that aggregation's
honest run.

Usage: ``.venv/bin/python benchmarks/bench_insider.py [--steps N] [--fleets 4 2]
[--modes robust default]``; the
learner and syncer processes run this file with ``--worker``. Quick-sized by default
(``bench_convergence_task.plan(quick=True)``).
"""

import argparse
import json
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
MODES = ("robust", "default")


def _install_attack(spec: dict[str, Any]) -> None:
    """Make this process's learner publish crafted deltas (``spec["attack"]``)."""
    import math

    import torch

    from gradientmail._node import publisher
    from gradientmail.protocol.aggregation import MAX_DELTA_RATIO
    from gradientmail.protocol.codec import encode_fragment

    mode, fleet = spec["attack"], spec["learners"]

    def crafted(job: Any, fragment_spec: Any, config: Any) -> tuple[bytes, float | None]:
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
            delta, fragment_spec, config.delta_encoding, block_size=config.block_size
        )
        return data, own

    publisher.encode_delta = crafted  # type: ignore[assignment]


def _worker(spec_path: Path, role: str) -> None:
    spec = json.loads(spec_path.read_text())
    if role == "syncer":
        result = syncer_worker(spec)
    else:
        index = int(role)
        learning = task.synthetic_learning(spec, index)
        if spec["attack"] is not None and index == spec["insider"]:
            _install_attack(spec)
            learning.tokens_per_step = spec["config"]["max_tokens_per_step"]
        result = learner_worker(spec, index, learning)
    (Path(spec["scratch"]) / f"result-{role}.json").write_text(json.dumps(result))


def _bounded(store: Path, insider: str | None) -> dict[str, int]:
    """How many honest and insider participations the run's records hold, and how many of
    each a bound capped or clipped (``Participant.bounded``)."""
    import anyio

    from gradientmail.mailbox import LocalMailbox
    from gradientmail.store import Store

    async def count() -> dict[str, int]:
        counts = dict.fromkeys(("honest", "honest_bounded", "insider", "insider_bounded"), 0)
        async with LocalMailbox(store) as mailbox:
            reader = Store(mailbox, unverified=True)
            for round in await reader.record_rounds():
                record = await reader.record(round)
                for p in record.participants if record is not None else ():
                    who = "insider" if p.learner == insider else "honest"
                    counts[who] += 1
                    counts[f"{who}_bounded"] += isinstance(getattr(p, "bounded", None), str)
        return counts

    return anyio.run(count)


def run_arm(
    learners: int, attack: str | None, robust: bool, settings: dict[str, Any], scratch: Path
) -> dict[str, Any]:
    """One fleet of ``learners`` (the last one the insider when ``attack``), ``robust`` or
    not: the honest learners' final losses, and what the syncer's rounds recorded."""
    config = task.run_config(settings["sync_every"][0], settings["encodings"][0])
    config = msgspec.structs.replace(config, robust=robust)
    insider = learners - 1
    spec = {
        "seed": settings["seeds"][0],
        "steps": settings["steps"],
        "eval_every": settings["eval_every"],
        "learners": learners,
        "config": msgspec.structs.asdict(config),
        "scratch": str(scratch),
        "attack": attack,
        "insider": insider,
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
        "wall_seconds": launched["wall_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "ROLE"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help="steps per learner")
    parser.add_argument("--fleets", nargs="+", type=int, default=[4, 2])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes")
    args = parser.parse_args()
    if args.worker:
        _worker(Path(args.worker[0]), args.worker[1])
        return
    settings = task.plan(quick=True)
    if args.steps is not None:
        settings["steps"] = args.steps
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gm-bench-insider-") as scratch:
        for learners in args.fleets:
            for mode in args.modes:
                for attack in (None, *args.attacks):
                    name = f"{learners}-{mode}-{attack or 'honest'}"
                    robust = mode == "robust"
                    arm = run_arm(learners, attack, robust, settings, Path(scratch) / name)
                    honest = figures.get(f"{learners}-{mode}-honest", arm)["honest_final_loss"]
                    change = 100 * (arm["honest_final_loss"] - honest) / honest
                    figures[name] = arm | {"change_percent": change}
                    print(
                        f"{name:20} honest learners' loss {arm['honest_final_loss']:.6g} "
                        f"({change:+.2f}% over honest), {arm['rounds']} rounds, "
                        f"{arm['rejected']} rejected, {arm['wall_seconds']:.0f} s, "
                        f"participations {arm['participations']}",
                        flush=True,
                    )
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    sys.exit(main())
