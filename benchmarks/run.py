"""Run every benchmark, then generate ``docs/benchmarks.md`` from the results.

Each benchmark runs in its own process (``benchmarks/bench_*.py``), one after the other, so
none measures while another loads the machine. A benchmark that fails is reported and the
others still run; the page is generated from whatever result files exist, and the exit
status is 1 if any failed. ``run.json`` in the results directory records how long each
took.

The event-bus benchmark (``bench_events.py``, owned by the events workstream) writes only to
``benchmarks/results/events.json``, so it runs only when the results go there.
``convergence-bytes`` (``bench_convergence.py --long``) and ``rejoin`` (``bench_rejoin.py``)
are about length and size: a quick run leaves them out unless ``--only`` names them.

The transfer and memory benchmarks run here at the sizes that fit this run (128 MiB; 25M and
100M parameters); their large points (1 GiB, 250M parameters and the round latency across
processes) are ``nox -s bench-large`` (``--large``, written to ``transfer-large.json`` and
``memory-large.json``, which the page prefers).

Usage::

    .venv/bin/python benchmarks/run.py            # the full run (under 20 min on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # smoke-test sizes (under 2 min)
    .venv/bin/python benchmarks/run.py --quick --results /tmp/r --docs /tmp/d
    .venv/bin/python benchmarks/run.py --only store rounds
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import _harness as h
import report

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "store",
    "rounds",
    "overhead",
    "convergence",
    "events",
    "transfer",
    "memory",
    "convergence-bytes",
    "rejoin",
)
FULL_ONLY = ("convergence-bytes", "rejoin")
"""Left out of a quick run unless named with ``--only``: their point is size and length."""
LONG_STEPS = {False: 2400, True: 100}
"""``convergence-bytes``: the steps of ``bench_convergence.py --long`` (full, quick)."""


def _command(name: str, quick: bool) -> list[str]:
    """The command that runs benchmark ``name`` (``bench_{name}.py``, but for the long bytes
    run of the convergence benchmark)."""
    if name == "convergence-bytes":
        return [
            sys.executable,
            str(HERE / "bench_convergence.py"),
            "--long",
            str(LONG_STEPS[quick]),
        ]
    command = [sys.executable, str(HERE / f"bench_{name}.py")]
    return [*command, "--quick"] if quick else command


def selected(only: list[str] | None, quick: bool, results: Path) -> list[str]:
    """The benchmarks a run makes, in order: ``only``, else every one (a quick run leaves
    ``FULL_ONLY`` out), less ``events`` unless ``results`` is ``benchmarks/results``."""
    chosen = list(only or [b for b in BENCHMARKS if not (quick and b in FULL_ONLY)])
    if results.resolve() != h.RESULTS.resolve():
        chosen = [name for name in chosen if name != "events"]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (under 2 min)")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    parser.add_argument("--docs", type=Path, default=h.DOCS, help="where the page goes")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    args = parser.parse_args(argv)
    results: Path = args.results.resolve()
    results.mkdir(parents=True, exist_ok=True)
    chosen = selected(args.only, args.quick, results)
    if "events" in (args.only or BENCHMARKS) and "events" not in chosen:
        print("events: skipped (bench_events.py writes only to benchmarks/results/)")
    durations: dict[str, float] = {}
    failed: list[str] = []
    started = time.perf_counter()
    for name in chosen:
        command = _command(name, args.quick)
        if name != "events":
            command += ["--results", str(results)]
        print(f"== {name}", flush=True)
        began = time.perf_counter()
        code = subprocess.run(command, cwd=h.ROOT, check=False).returncode
        durations[name] = time.perf_counter() - began
        print(f"== {name}: {'ok' if code == 0 else f'FAILED ({code})'} in {durations[name]:.0f} s")
        if code != 0:
            failed.append(name)
    total = time.perf_counter() - started
    run = h.header("run", quick=args.quick, parameters={"benchmarks": chosen})
    run["figures"] = {"seconds": durations, "total_seconds": total, "failed": failed}
    h.write_result(results, "run", run)
    page = report.generate(results, args.docs)
    print(f"total {total:.0f} s; wrote {page}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
