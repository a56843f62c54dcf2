"""Store throughput: what the mailbox layer costs over the plain operations beneath it.

Two pairs, each under asyncio and trio, in one process:

- ``LocalMailbox`` against plain files: the same bytes written with ``open(path, "xb")``
  and read back with ``open(path, "rb")`` in a worker thread (``anyio.to_thread``, one hop
  per operation as the mailbox makes), into one flat directory; ``list`` against a sorted
  ``os.listdir`` of a directory holding as many files.
- ``S3Mailbox`` against direct aiobotocore calls (``put_object``, ``get_object`` and a
  paginated ``list_objects_v2``) on the same moto server, with the client configured as the
  mailbox configures its own (httpx transport handed whole bodies, standard retries), so
  the ratio isolates the mailbox layer: key checks, the concurrency limiter, the
  ``If-None-Match`` create-once header, error mapping. The mailbox's
  ``multipart_threshold`` is raised to 5 GiB so that it too sends every object in one PUT
  (``bench_transfer.py`` measures the parallel path).

put/get of 1 KiB, 1 MiB and 64 MiB objects (one at a time, a fresh key per put), and
``list`` over 10k keys. Each arm runs once per repetition, the two arms of a pair
alternating (ABBA); a ratio is the mailbox's median throughput over the baseline's
(above 1: the mailbox is faster).

Usage: ``.venv/bin/python benchmarks/bench_store.py [--quick] [--results DIR]``.
"""

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import _harness as h
import anyio
import anyio.to_thread

from gradientmail.mailbox import LocalMailbox, S3Mailbox

NAME = "store"
SIZES = (("1KiB", 1 << 10), ("1MiB", 1 << 20), ("64MiB", 64 << 20))
QUICK_SIZES = (("1KiB", 1 << 10), ("1MiB", 1 << 20), ("4MiB", 4 << 20))
BACKENDS = ("asyncio", "trio")
TARGET_RATIO = 0.9


def plan(quick: bool) -> dict[str, Any]:
    """Object sizes, how many operations of each, repetitions and keys to list (the quick
    variant replaces 64 MiB objects by 4 MiB ones)."""
    if quick:
        return {
            "sizes": dict(QUICK_SIZES),
            "ops": {"1KiB": 4, "1MiB": 2, "4MiB": 1},
            "repetitions": 2,
            "list_keys": 50,
            "list_repetitions": 2,
        }
    return {
        "sizes": dict(SIZES),
        "ops": {"1KiB": 100, "1MiB": 40, "64MiB": 2},
        "repetitions": 5,
        "list_keys": 10_000,
        "list_repetitions": 7,
    }


class Arm(Protocol):
    """One side of a pair: the four operations a throughput run needs."""

    async def put(self, key: str, data: bytes) -> None: ...
    async def get(self, key: str) -> bytes: ...
    async def list(self, prefix: str) -> Sequence[str]: ...
    async def remove(self, keys: Sequence[str]) -> None: ...


class MailboxArm:
    """A mailbox as an arm (``LocalMailbox`` or ``S3Mailbox``)."""

    def __init__(self, mailbox: LocalMailbox | S3Mailbox) -> None:
        self.mailbox = mailbox

    async def put(self, key: str, data: bytes) -> None:
        if not await self.mailbox.put_if_absent(key, data):
            raise RuntimeError(f"{key!r} existed before its put")

    async def get(self, key: str) -> bytes:
        data = await self.mailbox.get(key)
        if data is None:
            raise RuntimeError(f"{key!r} is missing after its put")
        return data

    async def list(self, prefix: str) -> Sequence[str]:
        return await self.mailbox.list(prefix)

    async def remove(self, keys: Sequence[str]) -> None:
        await self.mailbox.delete(keys)


def _write(path: Path, data: bytes) -> None:
    with open(path, "xb") as handle:
        handle.write(data)


def _read(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _listdir(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class FilesArm:
    """Plain files in one directory per prefix, one worker-thread hop per operation."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        prefix, _, name = key.rpartition("/")
        directory = self.root / prefix
        directory.mkdir(parents=True, exist_ok=True)
        return directory / name

    async def put(self, key: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(_write, self._path(key), data)

    async def get(self, key: str) -> bytes:
        return await anyio.to_thread.run_sync(_read, self._path(key))

    async def list(self, prefix: str) -> Sequence[str]:
        names = await anyio.to_thread.run_sync(_listdir, self.root / prefix.rstrip("/"))
        return [prefix + name for name in names]

    async def remove(self, keys: Sequence[str]) -> None:
        await anyio.to_thread.run_sync(_unlink, [self._path(key) for key in keys])


class BotoArm:
    """Direct aiobotocore calls on a client configured as ``S3Mailbox`` configures its own."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.client = client
        self.bucket = bucket

    async def put(self, key: str, data: bytes) -> None:
        await self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    async def get(self, key: str) -> bytes:
        response = await self.client.get_object(Bucket=self.bucket, Key=key)
        async with response["Body"] as stream:
            data: bytes = await stream.read()
        return data

    async def list(self, prefix: str) -> Sequence[str]:
        keys: list[str] = []
        request: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = await self.client.list_objects_v2(**request)
            keys.extend(item["Key"] for item in page.get("Contents", ()))
            if not page.get("IsTruncated"):
                return keys
            request["ContinuationToken"] = page["NextContinuationToken"]

    async def remove(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            await self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
            )


async def _timed(op: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await op()
    return time.perf_counter() - started


async def _throughput(
    arms: dict[str, Arm], size_name: str, size: int, ops: int, repetitions: int
) -> dict[str, Any]:
    """Put then get ``ops`` objects of ``size`` bytes through each arm, interleaved; the
    objects are removed and the file system synced after each turn (untimed)."""
    data = os.urandom(size)
    seconds: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name in arms}
    names = list(arms)
    for rep in range(repetitions):
        for name in names if rep % 2 == 0 else reversed(names):
            arm = arms[name]
            keys = [f"t{size_name}/r{rep}-{i:06d}" for i in range(ops)]

            async def puts(arm: Arm = arm, keys: list[str] = keys) -> None:
                for key in keys:
                    await arm.put(key, data)

            async def gets(arm: Arm = arm, keys: list[str] = keys) -> None:
                for key in keys:
                    if len(await arm.get(key)) != size:
                        raise RuntimeError(f"{key!r} came back with the wrong size")

            seconds[name]["put"].append(await _timed(puts))
            seconds[name]["get"].append(await _timed(gets))
            await arm.remove(keys)
            # The page cache writes this arm's bytes back later; without a sync the other
            # arm's turn pays for it (single 64 MiB local puts ranged from 0.07x to 6.4x).
            await anyio.to_thread.run_sync(os.sync)
    mib = size * ops / (1 << 20)
    figures: dict[str, Any] = {"size_bytes": size, "ops": ops}
    for op in ("put", "get"):
        per_arm = {}
        for name in names:
            values = seconds[name][op]
            per_arm[name] = {
                "mib_per_s": h.summary([mib / s for s in values]),
                "ops_per_s": h.summary([ops / s for s in values]),
            }
        mailbox, baseline = (per_arm[n]["mib_per_s"]["median"] for n in names)
        pairs = zip(seconds[names[0]][op], seconds[names[1]][op], strict=True)
        figures[op] = per_arm | {
            "ratio": h.ratio(mailbox, baseline),
            "ratio_per_repetition": h.summary([base / mine for mine, base in pairs]),
        }
    return figures


async def _list(
    arms: dict[str, Arm], keys: int, repetitions: int, populate: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    await populate()
    names = list(arms)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repetitions):
        for name in names if rep % 2 == 0 else reversed(names):
            started = time.perf_counter()
            listed = await arms[name].list("list/")
            seconds[name].append(time.perf_counter() - started)
            if len(listed) != keys:
                raise RuntimeError(f"{name} listed {len(listed)} keys, expected {keys}")
    per_arm = {name: {"keys_per_s": h.summary([keys / s for s in seconds[name]])} for name in names}
    mailbox, baseline = (per_arm[n]["keys_per_s"]["median"] for n in names)
    pairs = zip(seconds[names[0]], seconds[names[1]], strict=True)
    return (
        {"keys": keys}
        | per_arm
        | {
            "ratio": h.ratio(mailbox, baseline),
            "ratio_per_repetition": h.summary([base / mine for mine, base in pairs]),
        }
    )


async def _populate(arm: Arm, keys: int) -> None:
    limiter = anyio.CapacityLimiter(16)

    async def put(i: int) -> None:
        async with limiter:
            await arm.put(f"list/k{i:06d}", b"x" * 16)

    async with anyio.create_task_group() as tg:
        for i in range(keys):
            tg.start_soon(put, i)


async def _local(scratch: Path, settings: dict[str, Any]) -> dict[str, Any]:
    async with LocalMailbox(scratch / "mailbox") as mailbox:
        arms: dict[str, Arm] = {
            "mailbox": MailboxArm(mailbox),
            "baseline": FilesArm(scratch / "plain"),
        }
        figures: dict[str, Any] = {}
        for size_name, size in settings["sizes"].items():
            figures[size_name] = await _throughput(
                arms, size_name, size, settings["ops"][size_name], settings["repetitions"]
            )

        async def populate() -> None:
            for arm in arms.values():
                await _populate(arm, settings["list_keys"])

        figures["list"] = await _list(
            arms, settings["list_keys"], settings["list_repetitions"], populate
        )
    return figures


async def _s3(endpoint: str, bucket: str, settings: dict[str, Any]) -> dict[str, Any]:
    from aiobotocore.session import get_session

    # One PUT and one GET per object at every size, as the baseline makes: parallel parts
    # are measured against the single stream and raw aiobotocore by bench_transfer.py.
    mailbox = S3Mailbox(
        bucket, endpoint_url=endpoint, region="us-east-1", multipart_threshold=5 << 30
    )
    async with (
        mailbox,
        get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", config=mailbox._config
        ) as client,
    ):
        boto = BotoArm(client, bucket)
        arms: dict[str, Arm] = {"mailbox": MailboxArm(mailbox), "baseline": boto}
        figures: dict[str, Any] = {}
        for size_name, size in settings["sizes"].items():
            figures[size_name] = await _throughput(
                arms, size_name, size, settings["ops"][size_name], settings["repetitions"]
            )

        async def populate() -> None:
            # Both arms list the same keys; the second backend finds them already there.
            if len(await boto.list("list/")) != settings["list_keys"]:
                await _populate(boto, settings["list_keys"])

        figures["list"] = await _list(
            arms, settings["list_keys"], settings["list_repetitions"], populate
        )
    return figures


def _worst(figures: dict[str, Any]) -> dict[str, Any]:
    """The lowest ratio of every store (over backends, sizes, put/get/list) and where."""
    worst: dict[str, Any] = {}
    for backend, stores in figures.items():
        for store, sizes in stores.items():
            for size, entry in sizes.items():
                for op in ("put", "get") if size != "list" else ("list",):
                    value = entry[op]["ratio"] if op != "list" else entry["ratio"]
                    if value is None:
                        continue
                    if store not in worst or value < worst[store]["ratio"]:
                        where = "list" if op == "list" else f"{op} {size}"
                        worst[store] = {"ratio": value, "where": f"{where} on {backend}"}
    return worst


def run(results: Path, quick: bool) -> Path:
    """Measure, write ``results/store.json`` and return its path."""
    settings = plan(quick)
    result = h.header(NAME, quick=quick, parameters=settings)
    figures: dict[str, Any] = {}
    with h.aws_test_environment(), h.moto_server() as endpoint:
        bucket = h.create_bucket(endpoint)
        for backend in BACKENDS:
            with tempfile.TemporaryDirectory(prefix="gm-bench-store-") as scratch:
                local = anyio.run(_local, Path(scratch), settings, backend=backend)
            s3 = anyio.run(_s3, endpoint, bucket, settings, backend=backend)
            figures[backend] = {"local": local, "s3": s3}
    result["figures"] = figures
    result["worst"] = _worst(figures)
    result["target_ratio"] = TARGET_RATIO
    return h.write_result(results, NAME, result)


def _print(path: Path) -> None:
    import json

    result = json.loads(path.read_text())
    for backend, stores in result["figures"].items():
        for store, sizes in stores.items():
            cells = []
            for size, entry in sizes.items():
                if size == "list":
                    cells.append(f"list {entry['ratio']:.2f}")
                else:
                    cells.append(
                        f"{size} put {entry['put']['ratio']:.2f} get {entry['get']['ratio']:.2f}"
                    )
            print(f"{backend:8} {store:6} " + " | ".join(cells))
    print("worst:", {k: round(v["ratio"], 3) for k, v in result["worst"].items()})
    print(f"median load: {statistics.fmean([result['machine']['load_average_1m'] or 0.0]):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer operations, for smoke tests")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    path = run(args.results, args.quick)
    _print(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
