"""Benchmark of the event bus: emit's cost on the producer side, and events per second
through the bus into a no-op sink and into the JSON sink, on asyncio and trio.

Usage: ``.venv/bin/python benchmarks/bench_events.py [--quick]``. Prints a table and writes
``benchmarks/results/events.json`` (machine, versions, git commit, figures). Each figure is
the median of several repetitions; every run checks that no event was lost.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from gradientmail.events import Closed, Event, EventBus, RoundCommitted, json_logs
from gradientmail.protocol.records import BlobRef, Participant, RoundRecord

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "events.json"
TARGET_EMIT_US = 5.0


def _record() -> RoundRecord:
    blob = BlobRef(sha256="0" * 64, size=1 << 22, encoding="fp32")
    return RoundRecord(
        round=7,
        fragment=3,
        version=2,
        committed_by="alpha",
        participants=tuple(
            Participant(learner=f"l{i}", weight=0.25, steps=64, tokens=1 << 15, base_version=1)
            for i in range(4)
        ),
        quorum_seconds=1.0,
        grace_seconds=2.0,
        cosine=0.9,
        theta=blob,
        outer=blob,
        update=blob,
    )


class Counter:
    """A no-op sink that only counts."""

    name = "noop"

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: Event) -> None:
        self.count += 1


async def _wait(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(120):
        while not condition():  # noqa: ASYNC110 - polling a plain counter, with a deadline
            await anyio.sleep(0.0005)


async def emit_cost_loop(n: int) -> float:
    """µs per emit on the event-loop thread, the dispatcher running but not yet scheduled."""
    sink = Counter()
    bus = EventBus([sink], buffer=n)
    event = Closed("alpha", 1)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        started = time.perf_counter()
        for _ in range(n):
            bus.emit(event)
        elapsed = time.perf_counter() - started
        await _wait(lambda: sink.count == n)
        await bus.aclose()
    return elapsed / n * 1e6


async def emit_cost_thread(n: int) -> float:
    """µs per emit from a worker thread while the loop dispatches and delivers."""
    sink = Counter()
    bus = EventBus([sink], buffer=n)
    event = Closed("alpha", 1)

    def produce() -> float:
        started = time.perf_counter()
        for _ in range(n):
            bus.emit(event)
        return time.perf_counter() - started

    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        elapsed = await anyio.to_thread.run_sync(produce)
        await _wait(lambda: sink.count == n)
        await bus.aclose()
    return elapsed / n * 1e6


async def throughput(n: int, event: Event, json_to: Path | None) -> float:
    """Events per second from the first emit to the last delivery into a counting sink, with
    the JSON sink alongside when ``json_to`` is given (then every line is checked)."""
    sink = Counter()
    sinks: list[Any] = [sink]
    if json_to is not None:
        sinks.insert(0, json_logs(json_to))
    bus = EventBus(sinks, buffer=n)
    async with anyio.create_task_group() as tg:
        await tg.start(bus.run)
        started = time.perf_counter()
        for i in range(n):
            bus.emit(event)
            if i % 64 == 63:
                await anyio.lowlevel.checkpoint()
        await _wait(lambda: sink.count == n)
        elapsed = time.perf_counter() - started
        await bus.aclose()
    assert all(s.dropped == 0 for s in bus.statistics().sinks), bus.statistics()
    if json_to is not None and json_to != Path(os.devnull):
        with json_to.open(encoding="utf-8") as lines:
            assert sum(1 for _ in lines) == n
    return n / elapsed


def _median(runs: int, measure: Callable[[], float]) -> dict[str, float]:
    values = [measure() for _ in range(runs)]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--",
                "gradientmail/events",
                "benchmarks/bench_events.py",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _print_figures(figures: dict[str, Any], runs: int) -> None:
    """Each figure's median per backend, and the emit cost against its target."""
    print(f"{'figure (median of ' + str(runs) + ')':44} {'asyncio':>12} {'trio':>12}")
    for key in figures["asyncio"]:
        cells = [figures[backend][key]["median"] for backend in ("asyncio", "trio")]
        print(f"{key:44} " + " ".join(f"{cell:12,.2f}" for cell in cells))
    worst = max(figures[b]["emit_us_loop_thread"]["median"] for b in figures)
    verdict = "meets" if worst < TARGET_EMIT_US else "MISSES"
    print(f"emit on the loop thread: {worst:.2f} µs, {verdict} the {TARGET_EMIT_US} µs target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events and repetitions")
    args = parser.parse_args()
    n_emit, n_flow, runs = (20_000, 10_000, 3) if args.quick else (200_000, 50_000, 5)
    small, large = Closed("alpha", 1), RoundCommitted("alpha", _record(), 1.5)

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for backend in ("asyncio", "trio"):

            def run(fn: Callable[..., Any], *fn_args: Any, backend: str = backend) -> float:
                return float(anyio.run(fn, *fn_args, backend=backend))

            def to_file(event: Event, backend: str = backend) -> float:
                path = Path(scratch) / f"{backend}-{time.monotonic_ns()}.jsonl"
                result = run(throughput, n_flow, event, path)
                path.unlink()
                return result

            figures[backend] = {
                "emit_us_loop_thread": _median(runs, lambda: run(emit_cost_loop, n_emit)),
                "emit_us_worker_thread": _median(runs, lambda: run(emit_cost_thread, n_emit)),
                "events_per_s_noop": _median(runs, lambda: run(throughput, n_flow, small, None)),
                "events_per_s_json_file_small": _median(runs, lambda: to_file(small)),
                "events_per_s_json_file_round_committed": _median(runs, lambda: to_file(large)),
                "events_per_s_json_devnull_small": _median(
                    runs, lambda: run(throughput, n_flow, small, Path(os.devnull))
                ),
            }

    result = {
        "benchmark": "events",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "git_commit": _git_commit(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "versions": {
            "python": sys.version.split()[0],
            **{name: version(name) for name in ("anyio", "trio", "structlog", "msgspec")},
        },
        "parameters": {"emit_events": n_emit, "flow_events": n_flow, "repetitions": runs},
        "target_emit_us": TARGET_EMIT_US,
        "figures": figures,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    _print_figures(figures, runs)
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
