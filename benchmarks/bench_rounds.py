"""Round latency and scale: how long a round takes to close once its snapshots are in, and
how the store traffic grows with the number of learners.

- Latency: two learner nodes (each also a syncer) in one process on a ``LocalMailbox``,
  models of two fragments of ``P`` parameters each (P = 1M and 10M; int8 deltas and
  updates). The learners step in lockstep with simulated progress (a fixed random
  direction added to the weights), and after each round's snapshots the driver waits until
  a learner has seen the round's record, so rounds never overlap. The latency of a round is
  from the moment the put of its last snapshot returned to the moment a learner's listing
  or read first returned its record (``CountingMailbox`` timestamps both at the store
  interface).
- Scale: N simulated learners (N = 4, 16, 64), two of them also syncers, in one
  process on one ``MemoryMailbox`` wrapped to count every request by kind, with the demo's
  tiny model. They step in lockstep on a fixed tick; requests made and rounds committed
  are counted over a window after warm-up. Requests per round should grow linearly in N:
  the least-squares slope, over the sizes whose rounds kept the tick's pace, is requests
  per round per learner.

Usage: ``.venv/bin/python benchmarks/bench_rounds.py [--quick] [--results DIR]``.
"""

import argparse
import json
import operator
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import _harness as h
import anyio
import torch
from torch import nn

from gradientmail._node import Node, NodeOptions
from gradientmail._node import node as join_run
from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.protocol.records import RunConfig

NAME = "rounds"
POLL = 0.05
SCALE_POLL = 0.2
SCALE_TICK = 0.2
SCALE_SYNCERS = 2
"""Nodes of the scale runs that are also syncers; the others are learner-only. One Python
process cannot run 64 full nodes that all poll as followers and keep the rounds' pace."""
SCALE_FRAGMENTS = 4
SCALE_SYNC_EVERY = 16


def plan(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "latency_sizes": [100_000],
            "latency_rounds": 3,
            "scale_ns": [2, 4, 8],
            "scale_seconds": 3.2,
            "scale_warmup_s": 1.0,
        }
    return {
        "latency_sizes": [1_000_000, 10_000_000],
        "latency_rounds": 8,
        "scale_ns": [4, 16, 64],
        "scale_seconds": 16.0,
        "scale_warmup_s": 4.0,
    }


def _options(poll: float = POLL) -> NodeOptions:
    return NodeOptions(
        poll_interval=poll,
        lease_every=max(0.5, 5 * poll),
        lease_timeout=10.0,
        claim_timeout=30.0,
        creation_timeout=30.0,
        close_timeout=30.0,
    )


class Slab(nn.Module):
    """Two flat parameters of ``size`` elements: two fragments of exactly ``size``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(size, generator=generator) * 0.02)
        self.b = nn.Parameter(torch.randn(size, generator=generator) * 0.02)


class Simulated:
    """A learner that makes progress without training: each step adds its own fixed
    random direction (scale 1e-3) to every weight."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        generator = torch.Generator().manual_seed(1000 + seed)
        self.model = model
        self.directions = [
            torch.randn(p.shape, generator=generator) * 1e-3 for p in model.parameters()
        ]

    @torch.no_grad()
    def progress(self) -> None:
        for param, direction in zip(self.model.parameters(), self.directions, strict=True):
            param.add_(direction)


async def _until(condition: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` after ``within`` s."""
    deadline = time.perf_counter() + within
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {within} s")
        await anyio.sleep(0.002)


async def _cohort(
    models: list[nn.Module],
    mailbox: Mailbox,
    tally: h.Tally,
    config: RunConfig,
    body: Callable[[list[Node]], Any],
    options: NodeOptions,
    syncers: int | None = None,
) -> Any:
    """Join ``len(models)`` nodes (the first creates the run; the first ``syncers`` are
    syncers, all when None), run ``body(nodes)``, then cancel them all (closing without
    flush: the figures are taken before)."""
    nodes: dict[int, Node] = {}
    stop = anyio.Event()

    async def member(index: int, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        name = f"learner-{index:03d}"
        async with join_run(
            models[index],
            h.CountingMailbox(mailbox, tally, name),
            learner=name,
            config=config,
            options=options
            if syncers is None or index < syncers
            else replace(options, syncer=False),
        ) as node:
            nodes[index] = node
            task_status.started()
            await stop.wait()

    result: Any = None
    async with anyio.create_task_group() as tg:
        await tg.start(member, 0)
        for index in range(1, len(models)):
            tg.start_soon(member, index)
        await _until(lambda: len(nodes) == len(models), 120, "every node to join")
        try:
            result = await body([nodes[i] for i in range(len(models))])
        finally:
            tg.cancel_scope.cancel()
    return result


def _every_learner_fetched(tally: h.Tally, round: int, learners: int) -> bool:
    """Whether each of the ``learners`` has seen ``round``'s record and read a blob since:
    its update is downloaded, so its next step applies it and nothing is skipped."""
    seen = tally.record_seen_by.get(round, {})
    return len(seen) == learners and all(
        tally.blob_got.get(node, 0.0) > at for node, at in seen.items()
    )


async def latency(size: int, rounds: int, scratch: Path) -> dict[str, Any]:
    """Latency of ``rounds`` rounds whose fragments have ``size`` parameters."""
    learners = 2
    fragments = 2
    config = RunConfig(
        fragments=fragments,
        sync_every=fragments,
        delta_encoding="int8",
        update_encoding="int8",
        grace=1.0,
        quorum_fraction=1.0,
    )
    models: list[nn.Module] = [Slab(size) for _ in range(learners)]
    simulated = [Simulated(m, i) for i, m in enumerate(models)]
    tally = h.Tally()

    async def body(nodes: list[Node]) -> list[float]:
        waited: list[float] = []
        measured: set[int] = set()
        while len(waited) < rounds:
            for sim, node in zip(simulated, nodes, strict=True):
                sim.progress()
                await node.step(tokens=1)

            def landed() -> list[int]:
                return [
                    r for r, n in tally.snapshots.items() if n == learners and r not in measured
                ]

            # A due fragment whose new version is still being applied is not snapshotted
            # at this step; the learners then step again, as a training loop would.
            with anyio.move_on_after(2.0):
                await _until(lambda: bool(landed()), 300, "a round's snapshots")
            for round in landed():
                measured.add(round)
                await _until(
                    partial(operator.contains, tally.record_seen, round), 300, f"round {round}"
                )
                waited.append(tally.record_seen[round] - tally.snapshot_landed[round])
                fetched = partial(_every_learner_fetched, tally, round, learners)
                await _until(fetched, 300, f"every learner to fetch round {round}")
        return waited

    async with LocalMailbox(scratch) as mailbox:
        values = await _cohort(models, mailbox, tally, config, body, _options())
    # The first round also pays for the syncers' first loads; report it apart.
    steady = values[1:] if len(values) > 1 else values
    return {
        "rounds": len(steady),
        "first_round_s": values[0],
        "p50_s": h.percentile(steady, 50),
        "p90_s": h.percentile(steady, 90),
        "max_s": max(steady),
        "values_s": values,
    }


async def scale(n: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Requests per round and rounds per second with ``n`` simulated learners.

    The tick (a round every ``SCALE_SYNC_EVERY / SCALE_FRAGMENTS`` ticks) is slow enough
    that the rounds keep pace with it; requests per round are only comparable across N
    while they do, since the polls are paced by time, not by rounds.
    """
    config = RunConfig(
        fragments=SCALE_FRAGMENTS,
        sync_every=SCALE_SYNC_EVERY,
        delta_encoding="int8",
        update_encoding="int8",
    )
    tick = SCALE_TICK
    shape = GPTConfig.tiny()
    models: list[nn.Module] = [GPT(shape, seed=0) for _ in range(n)]
    simulated = [Simulated(m, i) for i, m in enumerate(models)]
    tally = h.Tally()
    mailbox = MemoryMailbox()

    async def body(nodes: list[Node]) -> dict[str, Any]:
        started = time.perf_counter()
        marks: dict[str, Any] = {}
        deadline = started + settings["scale_warmup_s"] + settings["scale_seconds"]
        next_tick = started
        while time.perf_counter() < deadline:
            if "start" not in marks and time.perf_counter() - started >= settings["scale_warmup_s"]:
                marks["start"] = (time.perf_counter(), _snapshot(tally))
            for sim, node in zip(simulated, nodes, strict=True):
                sim.progress()
                await node.step(tokens=512)
            next_tick += tick
            await anyio.sleep(max(0.0, next_tick - time.perf_counter()))
        marks["end"] = (time.perf_counter(), _snapshot(tally))
        return marks

    marks = await _cohort(models, mailbox, tally, config, body, _options(SCALE_POLL), SCALE_SYNCERS)
    (t0, before), (t1, after) = marks["start"], marks["end"]
    committed = [r for r, at in tally.record_seen.items() if t0 <= at <= t1]
    rounds = len(committed)
    by_op = {op: after[op] - before[op] for op in after}
    total = sum(by_op.values())
    nominal = SCALE_FRAGMENTS / (SCALE_SYNC_EVERY * tick)
    return {
        "n": n,
        "window_s": t1 - t0,
        "rounds": rounds,
        "rounds_per_s": rounds / (t1 - t0),
        "nominal_rounds_per_s": nominal,
        "kept_pace": rounds / (t1 - t0) >= 0.9 * nominal,
        "requests_per_s_per_learner": total / (t1 - t0) / n,
        "requests": by_op,
        "requests_per_round": total / rounds if rounds else None,
        "per_round": {op: v / rounds for op, v in by_op.items()} if rounds else {},
        "requests_per_round_per_learner": total / rounds / n if rounds else None,
    }


def _snapshot(tally: h.Tally) -> dict[str, int]:
    return {op: tally.total(op) for op in ("put", "get", "list", "delete")}


def run(results: Path, quick: bool) -> Path:
    settings = plan(quick)
    parameters = settings | {
        "poll_interval": POLL,
        "scale_poll_interval": SCALE_POLL,
        "latency_store": "LocalMailbox",
        "latency_learners": 2,
        "latency_fragments": 2,
        "latency_encoding": "int8",
        "scale_model": "GPTConfig.tiny",
        "scale_params": GPT(GPTConfig.tiny()).num_parameters(),
        "scale_fragments": SCALE_FRAGMENTS,
        "scale_sync_every": SCALE_SYNC_EVERY,
        "scale_tick_s": SCALE_TICK,
        "scale_syncers": SCALE_SYNCERS,
        "scale_encoding": "int8",
    }
    result = h.header(NAME, quick=quick, parameters=parameters)
    torch.set_num_threads(1)
    figures: dict[str, Any] = {"latency": {}, "scale": {"by_n": {}}}
    for size in settings["latency_sizes"]:
        with tempfile.TemporaryDirectory(prefix="gm-bench-rounds-") as scratch:
            figures["latency"][str(size)] = anyio.run(
                latency, size, settings["latency_rounds"], Path(scratch)
            )
    for n in settings["scale_ns"]:
        figures["scale"]["by_n"][str(n)] = anyio.run(scale, n, settings)
    # Requests per round of a size that fell behind the tick count the polls of rounds it
    # did not close, so only the sizes that kept pace are fitted.
    points = [
        (float(n), entry["requests_per_round"])
        for n, entry in figures["scale"]["by_n"].items()
        if entry["requests_per_round"] is not None and entry["kept_pace"]
    ]
    if len(points) >= 2:
        figures["scale"]["fit"] = h.fit_line([x for x, _ in points], [y for _, y in points])
        figures["scale"]["fit_ns"] = [int(x) for x, _ in points]
    result["figures"] = figures
    return h.write_result(results, NAME, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer learners")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    path = run(args.results, args.quick)
    figures = json.loads(path.read_text())["figures"]
    for size, entry in figures["latency"].items():
        p50, most = entry["p50_s"] * 1e3, entry["max_s"] * 1e3
        print(f"latency {size:>9} params: p50 {p50:.0f} ms, max {most:.0f} ms")
    for n, entry in figures["scale"]["by_n"].items():
        print(
            f"N={n:>3}: {entry['rounds']} rounds, {entry['rounds_per_s']:.2f}/s, "
            f"{entry['requests_per_round']} requests/round {entry['per_round']}"
        )
    if "fit" in figures["scale"]:
        print("fit:", figures["scale"]["fit"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
