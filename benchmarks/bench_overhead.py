"""Step overhead: steps per second of a training loop with a node against the same loop bare.

The demo's transformer at its ``medium`` shape (about 10M parameters) trains with AdamW on
the Markov language, as a synchronous loop in a worker thread. Each session alternates
bare, with the node, with the node, bare (ABBA), so a load that drifts during the run
weighs on both arms alike; its node segments run in one node (the only learner, its own
syncer, on a fresh ``LocalMailbox``, F=4, H=50, int8) entered before the first and left
after the second, so joining (the upload of Θ⁰) and the closing flush are not timed; the
bare segments run with no node at all. The full run has three sessions. The loop calls
``handle.step(tokens)`` after each optimizer step (``Node.run_in_thread``), and the time of
that call is measured on the caller.

The ratio is node steps per second over bare steps per second, for each pair of adjacent
segments; its median is the headline.

A second arm measures the blocking facade (``gradientmail.sync.node``, whose ``step`` crosses
into the node's own event loop thread through an anyio blocking portal) against the same
loop driven through ``Node.run_in_thread``'s handle. Each session runs four segments, handle,
facade, facade, handle (ABBA), each in a fresh node on a fresh ``LocalMailbox`` joined
before and left after its timed steps; the facade ratio is facade steps per second over
handle steps per second for each adjacent pair, and its median is that arm's headline.
Beside it, ``facade_ratio_of_calls`` is the ratio the medians of the two arms' ``step()``
calls imply for one median training step: (train + handle call) / (train + facade call),
which load that drifts between segments does not move.

A third arm measures what a node costs while nothing happens: the CPU time (user and system,
every thread of the process) of a learner node that takes no steps (``syncer=False``, on a
fresh ``LocalMailbox``), and of that learner with a dedicated syncer node beside it in the
same process, over ``idle_seconds`` of wall time at each ``poll_interval`` (the product's
lease pacing), less the process's own CPU over as long with no node (measured in the same
run). The figure is percent of one core; the syncer's is the pair's less the learner's.

Usage: ``.venv/bin/python benchmarks/bench_overhead.py [--quick] [--results DIR]``.
"""

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _harness as h
import anyio
import torch

import gradientmail.sync
from gradientmail._node import NodeOptions, StepHandle
from gradientmail._node import node as join_run
from gradientmail.demo.data import synthetic
from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.events import Event, RoundCommitted
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol.records import RunConfig

NAME = "overhead"
TARGET_RATIO = 0.98
FRAGMENTS = 4
CONTEXT = 32
BATCH = 4


def plan(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "model": "small",
            "sync_every": 8,
            "segment_steps": 8,
            "sessions": 1,
            "idle_polls": [0.25],
            "idle_seconds": 1.0,
        }
    return {
        "model": "medium",
        "sync_every": 50,
        "segment_steps": 60,
        "sessions": 3,
        "idle_polls": [0.05, 0.25, 0.5, 1.0],
        "idle_seconds": 10.0,
    }


def _trainer(model: GPT, batches: Iterator[torch.Tensor]) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        started = time.perf_counter()
        loss = model.loss(next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return time.perf_counter() - started

    return step


def _bare(step: Callable[[], float], steps: int) -> tuple[float, list[float]]:
    started = time.perf_counter()
    trains = [step() for _ in range(steps)]
    return time.perf_counter() - started, trains


def _model_and_step(settings: dict[str, Any]) -> tuple[GPT, Callable[[], float]]:
    """The model of ``settings`` and its timed training step, warmed up."""
    shape = {"small": GPTConfig.small, "medium": GPTConfig.medium}[settings["model"]]
    model = GPT(shape(vocab_size=64, context=CONTEXT), seed=0)
    corpus = synthetic(length=CONTEXT, seed=0)
    # Batches are drawn ahead so that sampling the Markov chain is not part of either arm.
    total = 8 * settings["sessions"] * settings["segment_steps"] + 2
    pool = [next(corpus.train(0, batch_size=BATCH, length=CONTEXT)) for _ in range(8)]
    batches = iter([pool[i % len(pool)] for i in range(total)])
    step = _trainer(model, batches)
    step()  # warm-up: allocate the optimizer state before anything is timed
    return model, step


def _node_segment(
    step: Callable[[], float], n: int, step_times: list[float]
) -> Callable[[StepHandle], float]:
    """``n`` training steps, each reported to the node (that call's time appended to
    ``step_times``), on the node's training thread; their wall time."""

    def with_node(handle: StepHandle) -> float:
        started = time.perf_counter()
        for _ in range(n):
            step()
            before = time.perf_counter()
            handle.step(BATCH * CONTEXT)
            step_times.append(time.perf_counter() - before)
        return time.perf_counter() - started

    return with_node


async def _interleaved_arm(
    settings: dict[str, Any],
    scratch: Path,
    model: GPT,
    step: Callable[[], float],
    config: RunConfig,
) -> dict[str, Any]:
    """Per session: bare steps, two segments under a node, bare steps again; the rates,
    their ratios, the node's ``step()`` times and bytes."""
    n = settings["segment_steps"]
    bare_seconds: list[float] = []
    node_seconds: list[float] = []
    train_times: list[float] = []
    step_times: list[float] = []
    committed = 0

    def count(event: Event) -> None:
        nonlocal committed
        if isinstance(event, RoundCommitted):
            committed += 1

    with_node = _node_segment(step, n, step_times)
    ratios: list[float] = []
    published = downloaded = 0
    for session in range(settings["sessions"]):
        first, trains = await anyio.to_thread.run_sync(_bare, step, n)
        train_times += trains
        async with (
            LocalMailbox(scratch / f"run-{session}") as mailbox,
            join_run(model, mailbox, learner="solo", config=config, sinks=[count]) as node,
        ):
            middle = [await node.run_in_thread(with_node) for _ in range(2)]
            state = node.state
        published += state.bytes_published
        downloaded += state.bytes_downloaded
        last, trains = await anyio.to_thread.run_sync(_bare, step, n)
        train_times += trains
        bare_seconds += [first, last]
        node_seconds += middle
        ratios += [first / middle[0], last / middle[1]]
    ms = [t * 1e3 for t in step_times]
    return {
        "steps_per_s_bare": h.summary([n / s for s in bare_seconds]),
        "steps_per_s_node": h.summary([n / s for s in node_seconds]),
        "ratio": h.summary(ratios),
        "step_ms_p50": h.percentile(ms, 50),
        "step_ms_p99": h.percentile(ms, 99),
        "step_ms_max": max(ms),
        "step_ms_mean": sum(ms) / len(ms),
        "train_ms_p50": h.percentile([t * 1e3 for t in train_times], 50),
        "rounds_committed": committed,
        "bytes_published": published,
        "bytes_downloaded": downloaded,
    }


async def measure(settings: dict[str, Any], scratch: Path) -> dict[str, Any]:
    model, step = _model_and_step(settings)
    config = RunConfig(
        fragments=FRAGMENTS,
        sync_every=settings["sync_every"],
        delta_encoding="int8",
        update_encoding="int8",
    )
    interleaved = await _interleaved_arm(settings, scratch, model, step, config)
    facade = await _facade_arm(settings, scratch, model, step, config)
    idle = await _idle_arm(settings, scratch, model, config)
    return interleaved | {"params": model.num_parameters()} | facade | idle


async def _facade_arm(
    settings: dict[str, Any],
    scratch: Path,
    model: GPT,
    step: Callable[[], float],
    config: RunConfig,
) -> dict[str, Any]:
    """The blocking facade against ``run_in_thread``'s handle, ABBA (module docstring)."""
    n = settings["segment_steps"]
    tokens = BATCH * CONTEXT
    times: dict[str, list[float]] = {"handle": [], "facade": []}
    trains: list[float] = []

    def loop(call: Callable[[int], None], arm: str) -> float:
        started = time.perf_counter()
        for _ in range(n):
            trains.append(step())
            before = time.perf_counter()
            call(tokens)
            times[arm].append(time.perf_counter() - before)
        return time.perf_counter() - started

    async def with_handle(directory: Path) -> float:
        async with (
            LocalMailbox(directory) as mailbox,
            join_run(model, mailbox, learner="solo", config=config) as node,
        ):
            return await node.run_in_thread(lambda handle: loop(handle.step, "handle"))

    def with_facade(directory: Path) -> float:
        with gradientmail.sync.node(model, str(directory), learner="solo", config=config) as node:
            return loop(node.step, "facade")

    ratios: list[float] = []
    for session in range(settings["sessions"]):
        base = scratch / f"facade-{session}"
        first = await with_handle(base / "a")
        second = await anyio.to_thread.run_sync(with_facade, base / "b")
        third = await anyio.to_thread.run_sync(with_facade, base / "c")
        fourth = await with_handle(base / "d")
        ratios += [first / second, fourth / third]
    handle_ms = [t * 1e3 for t in times["handle"]]
    facade_ms = [t * 1e3 for t in times["facade"]]
    train_ms = h.percentile([t * 1e3 for t in trains], 50)
    handle_p50, facade_p50 = h.percentile(handle_ms, 50), h.percentile(facade_ms, 50)
    return {
        "facade_ratio": h.summary(ratios),
        # What the medians of the calls alone imply for steps per second: a training step
        # plus the call, for each arm. Load that drifts between segments does not enter it.
        "facade_ratio_of_calls": (train_ms + handle_p50) / (train_ms + facade_p50),
        "facade_step_ms_p50": facade_p50,
        "facade_step_ms_p99": h.percentile(facade_ms, 99),
        "handle_step_ms_p50": handle_p50,
        "handle_step_ms_p99": h.percentile(handle_ms, 99),
    }


async def _idle_arm(
    settings: dict[str, Any], scratch: Path, model: GPT, config: RunConfig
) -> dict[str, Any]:
    """What an idle learner and a dedicated syncer cost, at each poll interval (module
    docstring)."""
    seconds = settings["idle_seconds"]

    async def cpu_over_window() -> float:
        await anyio.sleep(1.0)  # past the joins' own work
        started, cpu = time.perf_counter(), time.process_time()
        await anyio.sleep(seconds)
        return 100 * (time.process_time() - cpu) / (time.perf_counter() - started)

    baseline = await cpu_over_window()
    by_poll: dict[str, dict[str, float]] = {}
    for poll in settings["idle_polls"]:
        learner = NodeOptions(poll_interval=poll, syncer=False)
        syncer = NodeOptions(poll_interval=poll, syncer=True)
        async with (
            LocalMailbox(scratch / f"idle-{poll}") as mailbox,
            join_run(model, mailbox, learner="solo", config=config, options=learner),
        ):
            alone = await cpu_over_window()
            async with join_run(None, mailbox, learner="syncer", options=syncer):
                pair = await cpu_over_window()
        by_poll[str(poll)] = {
            "learner_core_percent": alone - baseline,
            "syncer_core_percent": pair - alone,
        }
    return {"idle_baseline_core_percent": baseline, "idle": by_poll}


def run(results: Path, quick: bool) -> Path:
    settings = plan(quick)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="gm-bench-overhead-") as scratch:
        figures = anyio.run(measure, settings, Path(scratch))
    parameters = settings | {
        "model": f"GPTConfig.{settings['model']}",
        "params": figures.pop("params"),
        "fragments": FRAGMENTS,
        "context": CONTEXT,
        "batch": BATCH,
        "encoding": "int8",
        "segments": 2 * settings["sessions"],
        "idle_lease_every": NodeOptions().lease_every,
        "torch_threads": 1,
    }
    result = h.header(NAME, quick=quick, parameters=parameters)
    result["figures"] = figures
    result["target_ratio"] = TARGET_RATIO
    result["target_facade_ratio"] = TARGET_RATIO
    return h.write_result(results, NAME, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 1M model, short segments")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    path = run(args.results, args.quick)
    figures = json.loads(path.read_text())["figures"]
    print(
        f"ratio {figures['ratio']['median']:.3f} ({figures['ratio']['values']}), step() p50 "
        f"{figures['step_ms_p50']:.2f} ms p99 {figures['step_ms_p99']:.2f} ms, "
        f"{figures['rounds_committed']} rounds"
    )
    print(
        f"facade ÷ handle {figures['facade_ratio']['median']:.3f} "
        f"({figures['facade_ratio']['values']}), from the calls' medians "
        f"{figures['facade_ratio_of_calls']:.4f}, step() p50 facade "
        f"{figures['facade_step_ms_p50']:.3f} ms, handle {figures['handle_step_ms_p50']:.3f} ms"
    )
    for poll, idle in figures["idle"].items():
        print(
            f"idle at poll {poll} s: learner {idle['learner_core_percent']:.2f}% of a core, "
            f"syncer {idle['syncer_core_percent']:.2f}%"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
