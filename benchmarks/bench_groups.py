"""Learner groups: two learners of two ranks each (DDP, or FSDP2) against two single-process
learners of the same global batch, on the demo's model and language (``docs/node.md``,
"Learner groups").

Each arm is one run on its own ``LocalMailbox``: two learners (one in the quick variant;
each also a syncer) train the demo's GPT on the synthetic Markov language for the same
number of steps. In the *group* arm a learner is two processes (DDP over gloo, CPU), in the
*fsdp* arm two processes whose parameters ``fully_shard`` cuts in two (a CPU mesh, gloo);
each rank takes half of the batch the single-process learner of the *single* arm takes,
drawn from the same stream, so the arms see the same data and the same mean gradients (up to
the order of float sums). The arms rotate over the repetitions. Per rank it records: the
time of each ``step()`` on the caller (in a DDP group: its control exchange and the
broadcasts of the fragments that changed; in a sharded one: its tick), the bytes it moved
through the store and through the group's collectives, the wall time of publishing one
fragment (``SnapshotPublished.seconds``, the leader's: in a sharded group from its own
part's encoding to the snapshot written with every rank's part), the bytes of the parameters
it holds, and the process's peak resident memory; per run, the evaluation loss of each
learner's final model and, read from the store after the run, the bytes of the snapshots
each rank uploaded (a sharded learner's parts by rank, a single learner's whole deltas).

    .venv/bin/python benchmarks/bench_groups.py [--quick] [--results DIR]
"""

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _harness as h
import anyio
import torch

STEPS, QUICK_STEPS = 240, 40
BATCH = 16  # the learner's batch; each of a group's two ranks takes half
CONTEXT = 32
LEARNERS = ("a", "b")
QUICK_LEARNERS = LEARNERS[:1]
"""The quick variant's: one learner per arm, whose ranks still take every per-rank path."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- one rank (a worker process) ------------------------------------------------------------


def _rank_main(spec: dict[str, Any]) -> None:
    """Train one rank of one learner and write its figures to ``spec['out']``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradientmail.demo.data import evaluate, synthetic
    from gradientmail.demo.model import GPT, GPTConfig

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    group = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        group = dist.new_group(backend="gloo")
    corpus = synthetic(length=CONTEXT, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig.small(vocab_size=corpus.vocab_size, context=CONTEXT))
    trained: torch.nn.Module = model
    if spec["arm"] == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif world > 1:
        trained = DistributedDataParallel(model)
    held = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = corpus.train(LEARNERS.index(spec["learner"]), batch_size=BATCH, length=CONTEXT)
    part = BATCH // world
    figures = anyio.run(_train, spec, trained, optimizer, stream, part, group)
    figures["eval_loss"] = evaluate(
        model, corpus.evaluation(batches=4, batch_size=32, length=CONTEXT)
    )
    figures["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures["param_bytes"] = held
    Path(spec["out"]).write_text(json.dumps(figures))
    sys.stderr.flush()
    os._exit(0)  # a gloo group's teardown can wait on peers that have already left


def _local(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank holds (a sharded DTensor's local rows)."""
    to_local = getattr(param, "to_local", None)
    return param if to_local is None else to_local()


def _train_step(
    trained: torch.nn.Module, optimizer: torch.optim.Optimizer, stream: Any, rank: int, part: int
) -> Callable[[], None]:
    """One optimizer step of ``trained`` on this rank's ``part`` rows of the next batch."""

    def train_step() -> None:
        batch = next(stream)[rank * part : (rank + 1) * part]
        logits = trained(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return train_step


async def _train(
    spec: dict[str, Any],
    trained: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stream: Any,
    part: int,
    group: Any,
) -> dict[str, Any]:
    import gradientmail
    from gradientmail.events import SnapshotPublished
    from gradientmail.patterns import Barrier

    # Every round's snapshots are kept: their bytes are read from the store after the run.
    config = gradientmail.RunConfig(fragments=2, sync_every=20, grace=1.0, keep_rounds=100_000)
    options = gradientmail.NodeOptions(
        poll_interval=0.05, lease_every=0.5, lease_timeout=10.0, close_timeout=60.0
    )
    published: list[float] = []

    def sink(event: object) -> None:
        if isinstance(event, SnapshotPublished):
            published.append(event.seconds)

    step_seconds: list[float] = []
    rank = spec["rank"]
    train_step = _train_step(trained, optimizer, stream, rank, part)
    mailbox = gradientmail.mailbox.LocalMailbox(Path(spec["run"]))
    async with (
        mailbox,
        gradientmail.node(
            trained,
            mailbox,
            learner=spec["learner"],
            config=config,
            options=options,
            sinks=[sink],
            group=group,
        ) as node,
    ):
        if rank == 0:
            await Barrier(mailbox, spec["learner"], poll_interval=0.02).wait(
                "start", parties=spec["learners"], timeout=300.0
            )

        for _ in range(spec["steps"]):
            await anyio.to_thread.run_sync(train_step)
            began = time.perf_counter()
            await node.step(tokens=BATCH * CONTEXT)  # the learner's, on every rank
            step_seconds.append(time.perf_counter() - began)
    state = node.state
    return {
        "step_ms": [1e3 * s for s in step_seconds],
        "publish_seconds": published,
        "store_up": state.bytes_published,
        "store_down": state.bytes_downloaded,
        "group_sent": state.group_bytes_sent,
        "group_received": state.group_bytes_received,
        "rounds": state.round + 1,
    }


# -- the benchmark ---------------------------------------------------------------------------


def _run_arm(arm: str, steps: int, work: Path, learners: tuple[str, ...]) -> dict[str, Any]:
    """One run of ``arm`` (``group``, ``fsdp`` or ``single``) with ``learners``; every rank's
    figures and the wall time."""
    world = 1 if arm == "single" else 2
    run = work / "run"
    processes = []
    began = time.perf_counter()
    for learner in learners:
        port = _free_port()
        for rank in range(world):
            spec = {
                "arm": arm,
                "learner": learner,
                "rank": rank,
                "world": world,
                "port": port,
                "run": str(run),
                "steps": steps,
                "learners": len(learners),
                "out": str(work / f"{learner}.{rank}.json"),
            }
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank", json.dumps(spec)],
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
    for process in processes:
        if process.wait(timeout=1800) != 0:
            raise RuntimeError(f"a rank of the {arm} arm exited {process.returncode}")
    seconds = time.perf_counter() - began
    ranks = {
        f"{learner}.{rank}": json.loads((work / f"{learner}.{rank}.json").read_text())
        for learner in learners
        for rank in range(world)
    }
    for name, (uploaded, count) in anyio.run(_snapshot_bytes, run).items():
        ranks[name]["snapshot_up"] = uploaded
        ranks[name]["snapshots"] = count
    return {"seconds": seconds, "ranks": ranks}


async def _snapshot_bytes(run: Path) -> dict[str, tuple[int, int]]:
    """The bytes of every snapshot's delta in the run and how many snapshots, by
    ``learner.rank`` (a part is its rank's, a whole delta rank 0's)."""
    from gradientmail.mailbox import LocalMailbox
    from gradientmail.store import Store

    found: dict[str, tuple[int, int]] = {}
    async with LocalMailbox(run) as mailbox:
        store = Store(mailbox)
        for round in await store.record_rounds():
            for snapshot, _ in await store.snapshots(round):
                if snapshot.parts:
                    sizes = [part.delta.size for part in snapshot.parts]
                else:
                    assert snapshot.delta
                    sizes = [snapshot.delta.size]
                for rank, size in enumerate(sizes):
                    name = f"{snapshot.learner}.{rank}"
                    total, count = found.get(name, (0, 0))
                    found[name] = (total + size, count + 1)
    return found


def _figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm and role (leader: rank 0; follower: rank 1): medians over the runs."""
    figures: dict[str, Any] = {}
    for arm, results in runs.items():
        roles = {"leader": ".0", "follower": ".1"} if arm != "single" else {"leader": ".0"}
        for role, suffix in roles.items():
            ranks = [
                r for result in results for n, r in result["ranks"].items() if n.endswith(suffix)
            ]
            steps = [v for r in ranks for v in r["step_ms"][1:]]
            published = [v for r in ranks for v in r["publish_seconds"]]
            figures[f"{arm}_{role}"] = {
                "step_ms_p50": h.percentile(steps, 50),
                "step_ms_mean": statistics.fmean(steps),
                "step_ms_p99": h.percentile(steps, 99),
                "publish_s_median": statistics.median(published) if published else None,
                "store_up": statistics.median(r["store_up"] for r in ranks),
                "store_down": statistics.median(r["store_down"] for r in ranks),
                "group_sent": statistics.median(r["group_sent"] for r in ranks),
                "group_received": statistics.median(r["group_received"] for r in ranks),
                "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in ranks),
                "param_bytes": statistics.median(r["param_bytes"] for r in ranks),
                "snapshot_up": statistics.median(r.get("snapshot_up", 0) for r in ranks),
                "snapshot_bytes": _per_snapshot(ranks),
            }
        losses = [
            r["eval_loss"]
            for result in results
            for n, r in result["ranks"].items()
            if n.endswith(".0")
        ]
        figures[f"{arm}_eval_loss"] = h.summary(losses)
        figures[f"{arm}_seconds"] = h.summary([result["seconds"] for result in results])
        figures[f"{arm}_rounds"] = statistics.median(
            r["rounds"] for result in results for r in result["ranks"].values()
        )
    group, single = figures["group_leader"], figures["single_leader"]
    figures["step_ms_added_p50"] = group["step_ms_p50"] - single["step_ms_p50"]
    figures["loss_ratio"] = h.ratio(
        figures["group_eval_loss"]["median"], figures["single_eval_loss"]["median"]
    )
    figures["leader_store_up_ratio"] = h.ratio(group["store_up"], single["store_up"])
    if "fsdp" in runs:
        sharded = (figures["fsdp_leader"], figures["fsdp_follower"])
        figures["fsdp_step_ms_added_p50"] = sharded[0]["step_ms_p50"] - single["step_ms_p50"]
        figures["fsdp_loss_ratio"] = h.ratio(
            figures["fsdp_eval_loss"]["median"], figures["single_eval_loss"]["median"]
        )
        for role, figure in zip(("leader", "follower"), sharded, strict=True):
            figures[f"fsdp_{role}_store_up_ratio"] = h.ratio(figure["store_up"], single["store_up"])
            figures[f"fsdp_{role}_snapshot_up_ratio"] = h.ratio(
                figure["snapshot_bytes"], single["snapshot_bytes"]
            )
            figures[f"fsdp_{role}_store_down_ratio"] = h.ratio(
                figure["store_down"], single["store_down"]
            )
            figures[f"fsdp_{role}_param_ratio"] = h.ratio(
                figure["param_bytes"], single["param_bytes"]
            )
    return figures


def _per_snapshot(ranks: list[dict[str, Any]]) -> float | None:
    """The mean bytes of one snapshot's delta (or of a rank's part of one) over ``ranks``."""
    count = sum(r.get("snapshots", 0) for r in ranks)
    return sum(r.get("snapshot_up", 0) for r in ranks) / count if count else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, one repetition")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank_main(json.loads(args.rank))
        return
    steps = QUICK_STEPS if args.quick else STEPS
    learners = QUICK_LEARNERS if args.quick else LEARNERS
    repetitions = 1 if args.quick else 3
    result = h.header(
        "groups",
        quick=args.quick,
        parameters={
            "model": "demo GPT small",
            "context": CONTEXT,
            "learner_batch": BATCH,
            "steps": steps,
            "learners": len(learners),
            "group_world": 2,
            "fragments": 2,
            "sync_every": 20,
            "repetitions": repetitions,
        },
    )
    arms = ("group", "fsdp", "single")
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for rep in range(repetitions):
        for arm in arms[rep % 3 :] + arms[: rep % 3]:
            with tempfile.TemporaryDirectory() as work:
                runs[arm].append(_run_arm(arm, steps, Path(work), learners))
                print(f"{arm}: {runs[arm][-1]['seconds']:.0f} s", flush=True)
    result["figures"] = _figures(runs)
    print(f"wrote {h.write_result(args.results, 'groups', result)}")


if __name__ == "__main__":
    main()
