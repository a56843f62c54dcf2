"""Peak memory of publishing a fragment and of closing a round against the fragment's size P,
and the latency of a round of a large fragment with learners and a syncer in separate
processes.

Memory: each point is a fresh process (``--point ROLE P``; the quick variant starts them all
at once) that first builds what its role holds between rounds, then measures the peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` once the setup is done) of
one operation run through the node's own code, above the resident set it started from
(``VmRSS``):

- ``publish``: a learner holding its live fragment and base B (fp32) copies the snapshot S
  out as the driver does (``LearnerDriver._copy_out`` on the CPU), encodes S − B and its
  norm (``_node.publisher.encode_delta``) and uploads the blob (``Store.put_blob`` on a
  ``LocalMailbox``). Bound: 4 (S) + b bytes per parameter (b: the delta encoding's bytes
  per parameter, 1 + 4/block_size at int8) plus a few pieces of ``CHUNK_ELEMENTS``.
- ``close``: a syncer holding θ and the momentum (fp32) downloads K snapshot blobs
  (``Store.get_blob``), checks them (``codec.open_fragment``), aggregates, steps and encodes
  the update (``protocol.outcome``), encodes θ′ and the momentum (``_fp32_blobs``) and
  uploads the three blobs: a checkpoint round (``RunConfig.checkpoint_every``), the
  costliest; the others write the update alone. Bound: (K + 1)·b (the snapshots, the
  update) + 4 (the mean) + 4 (θ′) + 4 (momentum′) + 8 (θ′ and momentum′ as fp32 blobs) =
  20 + (K + 1)·b bytes per parameter, plus pieces; while the update is encoded the raw θ′
  (4) is alive instead of the fp32 blobs (8), so that is not the peak.

The figures are peak-above-start per parameter at P = 25M, 100M and 250M and the slope of
a least-squares line through them (the intercept is the constant part: pieces, the
allocator, the interpreter).

Latency (``--latency``): a run of one fragment of P parameters (250M by default) on a
directory; ``LEARNERS`` learner-only processes and one syncer process (its node never
steps) step in lockstep through a file barrier, each learner writing when its snapshot's
put returned and when it first saw each record (wall clock, one machine). A round's latency
is from its last snapshot landing (the modification time of its file in the directory, not
the learner's event: under load an event reaches its sink late, which once put a record
before its own snapshots) to the first learner seeing its record, over the rounds whose
record counts every learner (a snapshot that missed its round lands after the record: once
in a CI run, a negative latency), and each learner steps until it has seen
``LATENCY_ROUNDS`` of those; the syncer's own peak RSS is reported beside it.

Usage: ``nice -n 19 .venv/bin/python benchmarks/bench_memory.py [--quick | --large]
[--results DIR]``; ``--large`` adds 250M and the latency run (``nox -s bench-large``).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import anyio
import anyio.to_thread
import torch

from gradientmail._node.commit import _fp32_blobs
from gradientmail._node.publisher import Job, encode_delta
from gradientmail._rebuild import Rebuilt
from gradientmail.mailbox import LocalMailbox
from gradientmail.mailbox.local import key_path
from gradientmail.protocol import keys
from gradientmail.protocol.aggregation import Candidate
from gradientmail.protocol.codec import encode_fragment, open_fragment
from gradientmail.protocol.learner_values import Publish
from gradientmail.protocol.outcome import outcome
from gradientmail.protocol.records import FragmentSpec, ParamSpec, RunConfig, Snapshot
from gradientmail.store import Store

NAME = "memory"
SIZES = {"quick": [2_000_000, 8_000_000], "full": [25_000_000, 100_000_000]}
LARGE_SIZES = [25_000_000, 100_000_000, 250_000_000]
SNAPSHOTS = 2
"""K, the snapshots a closing syncer aggregates (two learners: what one 24 GiB machine runs
at 250M parameters besides the syncer)."""
CONFIG = RunConfig(
    fragments=1, sync_every=1, delta_encoding="int8", update_encoding="int8", block_size=256
)
HERE = Path(__file__).resolve().parent


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _start_measuring() -> int:
    """Collect garbage, reset the peak resident set and return the current one."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def spec_of(size: int) -> FragmentSpec:
    """One fragment of ``size`` parameters: four matrices (the last takes the remainder)."""
    quarter = size // 4
    shapes = [(quarter // 1024, 1024)] * 3
    shapes.append((size - 3 * (quarter // 1024) * 1024,))
    return FragmentSpec(
        index=0,
        params=tuple(
            ParamSpec(name=f"layer.{i}.weight", shape=shape, dtype="float32")
            for i, shape in enumerate(shapes)
        ),
    )


def _tensors(spec: FragmentSpec, seed: int, scale: float) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(param.shape, generator=generator).mul_(scale) for param in spec.params)


async def _publish(size: int, scratch: Path) -> dict[str, Any]:
    spec = spec_of(size)
    base = _tensors(spec, 0, 0.02)
    live = tuple(b.clone() for b in base)
    for tensor, step in zip(live, _tensors(spec, 1, 1e-3), strict=True):
        tensor.add_(step)
    start = _start_measuring()
    began = time.perf_counter()
    snapshot = tuple(p.detach().to("cpu", copy=True) for p in live)
    publish = Publish(
        fragment=0, round=0, base_version=0, base=base, snapshot=snapshot, steps=1, tokens=1
    )
    data, _ = await anyio.to_thread.run_sync(
        encode_delta, Job(publish, None), spec, CONFIG.delta_encoding, CONFIG.block_size, 1
    )
    async with LocalMailbox(scratch) as mailbox:
        await Store(mailbox).put_blob(data, CONFIG.delta_encoding)
    return {"start": start, "peak": _status("VmHWM"), "seconds": time.perf_counter() - began}


async def _close(size: int, scratch: Path) -> dict[str, Any]:
    spec = spec_of(size)
    round = keys.round_of(0, 2, CONFIG.fragments)
    current = Rebuilt(1, _tensors(spec, 0, 0.02), _tensors(spec, 1, 1e-3), outer=True)
    async with LocalMailbox(scratch) as mailbox:
        store = Store(mailbox)
        snapshots = []
        for k in range(SNAPSHOTS):
            data = encode_fragment(
                _tensors(spec, 10 + k, 1e-3), spec, "int8", block_size=CONFIG.block_size
            )
            ref = await store.put_blob(data, "int8")
            del data
            snapshots.append(
                Snapshot(
                    learner=f"learner-{k}",
                    round=round,
                    fragment=0,
                    base_version=1,
                    steps=1,
                    tokens=1,
                    delta=ref,
                    norm=None,
                )
            )
        start = _start_measuring()
        began = time.perf_counter()
        candidates = []
        for snapshot in snapshots:
            blob = await store.get_blob(snapshot.delta)
            assert blob is not None
            delta = await anyio.to_thread.run_sync(open_fragment, blob, spec)
            candidates.append(Candidate(snapshot=snapshot, delta=delta))
        done = await anyio.to_thread.run_sync(
            outcome, current.version, current.theta, current.momentum, candidates, spec, CONFIG
        )
        assert len(done.result.participants) == SNAPSHOTS, done.result.rejected
        kept = (done.theta, done.momentum)
        blobs = await anyio.to_thread.run_sync(_fp32_blobs, kept, spec, 1)
        for data, encoding in ((blobs[0], "fp32"), (blobs[1], "fp32"), (done.update, "int8")):
            await store.put_blob(data, encoding)
    return {"start": start, "peak": _status("VmHWM"), "seconds": time.perf_counter() - began}


def _point(role: str, size: int) -> None:
    """One measurement in this (fresh) process; prints its JSON."""
    with tempfile.TemporaryDirectory(prefix="gm-bench-memory-") as scratch:
        measure = _publish if role == "publish" else _close
        figures = anyio.run(measure, size, Path(scratch))
    print(json.dumps(figures))


def _start(role: str, size: int) -> subprocess.Popen[str]:
    """One point's fresh process, started."""
    command = [sys.executable, str(Path(__file__)), "--point", role, str(size)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=h.ROOT
    )


def measure(role: str, size: int, process: subprocess.Popen[str] | None = None) -> dict[str, Any]:
    """Run one point in a fresh process (or wait for ``process``, started for it) and
    return its figures."""
    process = process or _start(role, size)
    out, err = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{role} at {size}: exit {process.returncode}\n{err[-2000:]}")
    figures: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    figures["above_start_per_param"] = (figures["peak"] - figures["start"]) / size
    figures["peak_per_param"] = figures["peak"] / size
    print(f"{role:8} P={size:>11,}: {figures['above_start_per_param']:.2f} B/param above start")
    return figures


def bound(role: str) -> float:
    """The stated bound above the held state, in bytes per parameter (pieces aside)."""
    b = 1 + 4 / CONFIG.block_size
    return 4 + b if role == "publish" else 20 + (SNAPSHOTS + 1) * b


def memory(sizes: list[int], at_once: bool = False) -> dict[str, Any]:
    """Every role's points, one process after another; ``at_once`` (the quick variant, whose
    sizes are small) starts every point's process at once: each measures its own peak."""
    started = {(r, s): _start(r, s) for r in ("publish", "close") for s in sizes} if at_once else {}
    figures: dict[str, Any] = {}
    for role in ("publish", "close"):
        points = {str(size): measure(role, size, started.get((role, size))) for size in sizes}
        above = [points[str(s)]["peak"] - points[str(s)]["start"] for s in sizes]
        figures[role] = {
            "points": points,
            "fit_above_start": h.fit_line([float(s) for s in sizes], [float(a) for a in above]),
            "fit_peak": h.fit_line(
                [float(s) for s in sizes], [float(points[str(s)]["peak"]) for s in sizes]
            ),
            "bound_per_param": bound(role),
        }
    return figures


LEARNERS = 2
LATENCY_ROUNDS = {"quick": 4, "large": 4}
PACE = 0.05
"""Seconds between a learner's steps: its compute, simulated."""
LATENCY_CONFIG = RunConfig(
    fragments=1,
    sync_every=1,
    delta_encoding="int8",
    update_encoding="int8",
    block_size=256,
    quorum_fraction=1.0,
    grace=1.0,
    keep_rounds=1000,
)
"""``keep_rounds`` past the run's length: the latencies come from the snapshots' files,
read once the run is over."""


class _Slabs(torch.nn.Module):
    """A model whose parameters are ``spec_of(size)``'s, the same on every node."""

    def __init__(self, size: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        for param in spec_of(size).params:
            tensor = torch.randn(param.shape, generator=generator).mul_(0.02)
            self.register_parameter(param.name.replace(".", "_"), torch.nn.Parameter(tensor))


def _options(syncer: bool) -> Any:
    from gradientmail._node import NodeOptions

    return NodeOptions(
        poll_interval=0.05,
        lease_every=1.0,
        lease_timeout=120.0,
        claim_timeout=600.0,
        creation_timeout=600.0,
        close_timeout=30.0,
        syncer=syncer,
    )


async def _learner(name: str, directory: Path, size: int, rounds: int, out: Path) -> None:
    from gradientmail._node import node as join_run
    from gradientmail.events import RoundRecorded, SnapshotPublished

    log: list[tuple[str, int, float]] = []
    # Rounds whose record counts every learner: on a slow machine the first rounds close
    # before the other learner has joined, and only these rounds have a latency.
    whole: set[int] = set()

    def sink(event: Any) -> None:
        if isinstance(event, SnapshotPublished):
            log.append(("published", event.round, time.time()))
        elif isinstance(event, RoundRecorded):
            log.append(("recorded", event.record.round, time.time()))
            if len(event.record.participants) == LEARNERS:
                whole.add(event.record.round)

    model = _Slabs(size)
    shift = 1e-4 * (1 + int(name.rsplit("-", 1)[1]))
    with anyio.CancelScope() as scope:
        async with (
            LocalMailbox(directory) as mailbox,
            join_run(
                model,
                mailbox,
                learner=name,
                config=LATENCY_CONFIG,
                options=_options(False),
                sinks=[sink],
            ) as node,
        ):
            while len(whole) < rounds:
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(shift)
                await node.step(tokens=1)
                await anyio.sleep(PACE)
            await anyio.Path(out).write_text(json.dumps({"log": log, "peak": _status("VmHWM")}))
            # Close without the flush: the figures are taken.
            scope.cancel()


async def _syncer(directory: Path, out: Path) -> None:
    from gradientmail._node import node as join_run

    with anyio.CancelScope() as scope:
        async with (
            LocalMailbox(directory) as mailbox,
            join_run(None, mailbox, learner="syncer", options=_options(True)),
        ):
            # Until the driver closes our standard input: the learners are done.
            await anyio.to_thread.run_sync(sys.stdin.read)
            await anyio.Path(out).write_text(json.dumps({"peak": _status("VmHWM")}))
            scope.cancel()


def latency(size: int, rounds: int) -> dict[str, Any]:
    """Round latency of a run of one fragment of ``size`` parameters: ``LEARNERS`` learner
    processes and a syncer process on one directory."""
    with tempfile.TemporaryDirectory(prefix="gm-bench-latency-") as scratch:
        root = Path(scratch)
        me = [sys.executable, str(Path(__file__)), "--node"]
        run = str(root / "run")
        learners = [
            subprocess.Popen(
                [*me, f"learner-{i}", run, str(size), str(rounds), str(root / f"l{i}")],
                cwd=h.ROOT,
            )
            for i in range(LEARNERS)
        ]
        syncer = subprocess.Popen(
            [*me, "syncer", run, str(size), "0", str(root / "syncer")],
            cwd=h.ROOT,
            stdin=subprocess.PIPE,
        )
        try:
            codes = [p.wait(timeout=1800) for p in learners]
            assert syncer.stdin is not None
            syncer.stdin.close()
            codes.append(syncer.wait(timeout=120))
        finally:
            for process in [*learners, syncer]:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        if any(codes):
            raise RuntimeError(f"latency run at {size}: exit codes {codes}")
        outputs = [json.loads((root / f"l{i}").read_text()) for i in range(LEARNERS)]
        syncer_peak = json.loads((root / "syncer").read_text())["peak"]
        landed, whole = anyio.run(_landed, Path(run))
    return _latencies(outputs, landed, whole, syncer_peak, size)


async def _landed(directory: Path) -> tuple[dict[int, list[float]], set[int]]:
    """Per round, the modification time of each snapshot's file in ``directory``; and the
    rounds whose record counts every learner."""
    async with LocalMailbox(directory) as mailbox:
        found = await mailbox.list(keys.ROUNDS)
        store = Store(mailbox)
        whole = set()
        for round in await store.record_rounds(after=-1):
            record = await store.record(round)
            if record is not None and len(record.participants) == LEARNERS:
                whole.add(round)
    landed: dict[int, list[float]] = {}
    for key in found:
        parsed = keys.parse_snapshot(key)
        if parsed is not None:
            path = directory.joinpath("objects", *key_path(key))
            landed.setdefault(parsed[0], []).append(path.stat().st_mtime)
    return landed, whole


def _latencies(
    outputs: list[dict[str, Any]],
    landed: dict[int, list[float]],
    whole: set[int],
    syncer_peak: int,
    size: int,
) -> dict[str, Any]:
    published: dict[int, int] = {}
    recorded: dict[int, float] = {}
    for output in outputs:
        for kind, round, at in output["log"]:
            if kind == "published":
                published[round] = published.get(round, 0) + 1
            else:
                recorded[round] = min(at, recorded.get(round, at))
    rounds = sorted(
        r
        for r in recorded
        if r in whole and published.get(r) == LEARNERS and len(landed.get(r, ())) == LEARNERS
    )
    values = [recorded[r] - max(landed[r]) for r in rounds]
    steady = values[1:] if len(values) > 1 else values
    return {
        "size": size,
        "learners": LEARNERS,
        "rounds": rounds,
        "values_s": values,
        "first_round_s": values[0] if values else None,
        "p50_s": h.percentile(steady, 50) if steady else None,
        "max_s": max(steady) if steady else None,
        "syncer_peak_bytes": syncer_peak,
        "syncer_peak_per_param": syncer_peak / size,
        "learner_peak_per_param": max(o["peak"] for o in outputs) / size,
    }


def run(results: Path, quick: bool, large: bool) -> Path:
    """Measure, write ``results/memory.json`` (``memory-large.json`` with ``large``)."""
    sizes = LARGE_SIZES if large else SIZES["quick" if quick else "full"]
    name = f"{NAME}-large" if large else NAME
    result = h.header(name, quick=quick, parameters={"sizes": sizes, "snapshots": SNAPSHOTS})
    result["figures"] = {"memory": memory(sizes, at_once=quick and not large)}
    if large or quick:
        size = 250_000_000 if large else 2_000_000
        rounds = LATENCY_ROUNDS["large" if large else "quick"]
        result["figures"]["latency"] = latency(size, rounds)
        print(f"latency at {size:,}: {result['figures']['latency']['values_s']}")
    result["load_average_1m_after"] = os.getloadavg()[0]
    return h.write_result(results, name, result)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--point":
        _point(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--node":
        name, directory, size, rounds, out = sys.argv[2:7]
        if name == "syncer":
            anyio.run(_syncer, Path(directory), Path(out))
        else:
            anyio.run(_learner, name, Path(directory), int(size), int(rounds), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2M and 8M parameters")
    parser.add_argument("--large", action="store_true", help="25M, 100M, 250M and latency")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    print(f"wrote {run(args.results, args.quick, args.large)}")


if __name__ == "__main__":
    main()
