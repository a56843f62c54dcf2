"""What every benchmark shares: the result file's header, summaries of repeated measures,
interleaved A/B timing, a moto server, and a request-counting mailbox wrapper.

A result is ``<results>/<name>.json``: ``benchmark``, ``date``, ``quick``, ``git_commit``
(``+dirty`` when the package or the benchmarks differ from it), ``machine``, ``versions``,
``parameters`` and ``figures``. Every figure that compares two things is a ratio of two
measures taken in the same run, interleaved, so a slow or busy machine slows both sides.
"""

import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from gradientmail.mailbox import Mailbox
from gradientmail.protocol.keys import parse_record_slot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"

_PACKAGES = (
    "torch",
    "anyio",
    "trio",
    "aiobotocore",
    "botocore",
    "httpx",
    "moto",
    "msgspec",
    "safetensors",
    "structlog",
    "numpy",
    "matplotlib",
)


def git_commit() -> str:
    """HEAD, with ``+dirty`` when ``gradientmail/`` or ``benchmarks/`` (results aside)
    differ from it; ``unknown`` outside a git checkout."""
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
                "gradientmail",
                "benchmarks",
                ":!benchmarks/results",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine the figures come from, with its load when this was called."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def header(name: str, *, quick: bool, parameters: dict[str, Any]) -> dict[str, Any]:
    """The fields every result file starts with."""
    return {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "git_commit": git_commit(),
        "machine": machine(),
        "versions": {"python": sys.version.split()[0]}
        | {package: _version(package) for package in _PACKAGES},
        "parameters": parameters,
    }


def write_result(results: Path, name: str, result: dict[str, Any]) -> Path:
    """Write ``result`` (with the machine's load at the end added) to ``results/name.json``."""
    result = result | {"load_average_1m_after": machine()["load_average_1m"]}
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max, mean, sample standard deviation (0 for one value) and the values."""
    if not values:
        raise ValueError("a summary needs at least one value")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
        "values": list(values),
    }


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or None when the denominator is not positive."""
    return numerator / denominator if denominator > 0 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("a percentile needs at least one value")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = slope * x + intercept`` and its coefficient of determination."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a line needs at least two points")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"slope": slope, "intercept": intercept, "r2": 1 - residual / total if total else 1.0}


def interleaved(repetitions: int, arms: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Run every arm once per repetition, alternating their order (ABBA...), so that a
    machine that drifts (another job starting) drifts both; each arm's values in order."""
    values: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for rep in range(repetitions):
        for name in names if rep % 2 == 0 else reversed(names):
            values[name].append(arms[name]())
    return values


@contextmanager
def aws_test_environment() -> Iterator[None]:
    """Fake credentials in the environment, so botocore stops there (no shared files, no
    instance metadata); the previous environment is restored on exit."""
    saved = dict(os.environ)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
    )
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def moto_server(timeout: float = 30.0) -> Iterator[str]:
    """A ``python -m moto.server`` on a free port of 127.0.0.1; yields its endpoint URL and
    kills it on exit. ``RuntimeError`` when it does not accept connections in time."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"moto server on port {port} exited at start")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server on port {port} did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def create_bucket(endpoint: str) -> str:
    """A fresh bucket on the moto server at ``endpoint`` (a synchronous botocore call)."""
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1"
    )
    name = f"bench-{uuid.uuid4().hex[:12]}"
    try:
        client.create_bucket(Bucket=name)
    finally:
        client.close()
    return name


def key_kind(key: str) -> str:
    """The kind of object a run's key names (the first segment; ``snapshots`` and
    ``claims`` for the two kinds under ``rounds/``)."""
    parts = key.split("/")
    if parts[0] == "rounds" and len(parts) >= 3:
        return parts[2]
    return parts[0].rstrip("/") or "root"


class Tally:
    """Requests and bytes counted by ``CountingMailbox`` wrappers, by node and kind.

    ``requests[node][op]`` counts ``put``, ``get``, ``list`` and ``delete`` calls;
    ``by_key[node][op:kind]`` the same split by the kind of key (``key_kind``);
    ``bytes_up`` / ``bytes_down`` what each node wrote and read, and ``bytes_by_kind[node]``
    the same split as ``up:kind`` / ``down:kind``. ``snapshot_landed[round]``
    is the ``perf_counter`` at which the last snapshot put of a round returned
    (``snapshots[round]`` counts them), ``record_seen[round]`` when a list or a get first
    returned that round's record (``record_seen_by[round][node]``: each node's first), and
    ``blob_got[node]`` when the node's last blob read returned. Only touched
    from one event loop's thread, so it needs no lock.
    """

    def __init__(self) -> None:
        self.requests: dict[str, dict[str, int]] = {}
        self.by_key: dict[str, dict[str, int]] = {}
        self.bytes_up: dict[str, int] = {}
        self.bytes_down: dict[str, int] = {}
        self.bytes_by_kind: dict[str, dict[str, int]] = {}
        self.snapshot_landed: dict[int, float] = {}
        self.snapshots: dict[int, int] = {}
        self.record_seen: dict[int, float] = {}
        self.record_seen_by: dict[int, dict[str, float]] = {}
        self.blob_got: dict[str, float] = {}

    def count(self, node: str, op: str, kind: str) -> None:
        ops = self.requests.setdefault(node, {"put": 0, "get": 0, "list": 0, "delete": 0})
        ops[op] += 1
        split = self.by_key.setdefault(node, {})
        split[f"{op}:{kind}"] = split.get(f"{op}:{kind}", 0) + 1

    def moved(self, node: str, direction: str, kind: str, size: int) -> None:
        totals = self.bytes_up if direction == "up" else self.bytes_down
        totals[node] = totals.get(node, 0) + size
        split = self.bytes_by_kind.setdefault(node, {})
        split[f"{direction}:{kind}"] = split.get(f"{direction}:{kind}", 0) + size

    def total(self, op: str | None = None) -> int:
        """Requests of ``op`` (every op when None) over every node."""
        return sum(
            n for ops in self.requests.values() for name, n in ops.items() if op in (None, name)
        )


class CountingMailbox:
    """Forwards to ``inner`` and counts each request in ``tally`` under ``node``.

    It times the two ends of a round's latency: a put of a snapshot key notes when it
    returned (the last one of a round wins), and a list whose answer holds a record key, or
    a get that returned a record, notes when it returned if that record was not seen before.
    Entering and leaving do nothing: whoever built ``inner`` owns it.
    """

    def __init__(self, inner: Mailbox, tally: Tally, node: str) -> None:
        self._inner = inner
        self._tally = tally
        self._node = node

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        self._tally.count(self._node, "put", key_kind(key))
        created = await self._inner.put_if_absent(key, data)
        if created:
            self._tally.moved(self._node, "up", key_kind(key), len(data))
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "rounds" and parts[2] == "snapshots":
                round = int(parts[1])
                self._tally.snapshot_landed[round] = time.perf_counter()
                self._tally.snapshots[round] = self._tally.snapshots.get(round, 0) + 1
        return created

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._tally.count(self._node, "get", key_kind(key))
        data = await self._inner.get(key, max_bytes=max_bytes)
        if data is not None:
            self._tally.moved(self._node, "down", key_kind(key), len(data))
            if key.startswith("blobs/"):
                self._tally.blob_got[self._node] = time.perf_counter()
            else:
                self._saw_record(key, time.perf_counter())
        return data

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self._tally.count(self._node, "list", key_kind(prefix) if prefix else "root")
        keys = await self._inner.list(prefix, after=after)
        now = time.perf_counter()
        for key in keys:
            self._saw_record(key, now)
        return keys

    def _saw_record(self, key: str, now: float) -> None:
        """Note ``now`` for the round of ``key`` when it is a record key (any slot)."""
        parsed = parse_record_slot(key)
        if parsed is None:
            return
        round = parsed[0]
        self._tally.record_seen.setdefault(round, now)
        self._tally.record_seen_by.setdefault(round, {}).setdefault(self._node, now)

    async def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._tally.count(self._node, "delete", key_kind(keys[0]) if keys else "none")
        await self._inner.delete(keys)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None
