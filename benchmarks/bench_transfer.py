"""Large-object transfer: parallel parts against one stream, and against the raw client.

One large blob (1 GiB with ``--large``, 128 MiB by default, 12 MiB with ``--quick``) is
put and then got, under asyncio and trio, through:

- ``S3Mailbox`` on a moto server, three arms: the mailbox as configured by default
  (``parallel``: a multipart upload and ranged GETs, ``part_concurrency`` at once); the same
  mailbox's single-stream path (``single``: ``multipart_threshold`` at 5 GiB, so one PUT and
  one GET); and raw aiobotocore doing the same parallel transfer (``raw``: the same part
  size and concurrency, ``create_multipart_upload``/``upload_part``/
  ``complete_multipart_upload`` and ranged ``get_object`` into one ``bytearray`` it returns
  as is, on a client configured as the mailbox configures its own). The raw arm runs
  under trio too: aiobotocore's httpx backend is the same code on both loops.
- ``LocalMailbox`` on a temporary directory: the mailbox (``parallel``: chunked writes and
  reads off the event loop), its single-hop path (``single``: both chunk sizes raised above
  the object) and plain files (``raw``: ``bench_store.FilesArm``, ``open(path,
  "xb").write`` and ``open(path, "rb").read`` in one worker-thread hop each).

Every arm first runs once untimed (warm-up); then the arms alternate within each
repetition (rotating their order); a ratio is the median
throughput of ``parallel`` over that of ``single`` or ``raw`` (above 1: the mailbox is
faster). With ``--sweep``, the S3 put and get are also timed for
several part sizes and concurrencies (256 MiB, one repetition each, asyncio), which is
where the defaults come from.

On moto at 127.0.0.1 there is no network: a transfer costs the client's and the server's
CPU on the same two cores, and moto answers each ranged GET by reading the whole object
(``FakeKey.value``) and slicing it, so N ranges cost it N whole reads. The figures say what
the mailbox's own code costs against the raw client doing the same requests, not what
parallel parts gain on S3 (per-connection bandwidth and first-byte latency, which they
spread, are absent here).

Usage: ``nice -n 19 .venv/bin/python benchmarks/bench_transfer.py [--quick | --large]
[--sweep] [--size BYTES] [--results DIR]``; ``--large`` writes ``transfer-large.json``
(``nox -s bench-large``).
"""

import argparse
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import _harness as h
import anyio
import anyio.to_thread
from aiobotocore.config import AioConfig
from bench_store import FilesArm

import gradientmail.mailbox._local_reads as local_reads
import gradientmail.mailbox._local_writes as local_writes
from gradientmail.mailbox import LocalMailbox, S3Mailbox
from gradientmail.mailbox._s3_parts import MIN_PART_BYTES, part_ranges

NAME = "transfer"
BACKENDS = ("asyncio", "trio")
# The full benchmark run's size fits its time budget; 1 GiB is ``--large``'s.
SIZE = 128 << 20
LARGE_SIZE = 1 << 30
QUICK_SIZE = 12 << 20
QUICK_PARTS = {"part_size": MIN_PART_BYTES, "multipart_threshold": MIN_PART_BYTES}
QUICK_CHUNK = 4 << 20
"""The quick variant's ``parallel`` arms: S3 parts of 5 MiB (S3's smallest) above 5 MiB and
local chunks of 4 MiB, so that its small blob still goes in three parts and three chunks,
as the default configuration sends a large one."""
SWEEP_SIZE = 256 << 20
READ_TIMEOUT = 600.0
"""Seconds per socket read or write, for every arm: one stream of 1 GiB into moto on a loaded
machine stalls longer than the mailbox's 20 s read timeout and aiobotocore's 5 s write
timeout (which ``S3Mailbox`` leaves at its default)."""


def _patient(mailbox: S3Mailbox) -> S3Mailbox:
    """``mailbox`` with ``READ_TIMEOUT`` for socket writes too (before it is entered)."""
    mailbox._config = mailbox._config.merge(
        AioConfig(connector_args={"write_timeout": READ_TIMEOUT})
    )
    return mailbox


TARGET_RAW_RATIO = 0.9
SWEEP = {"part_size": (8 << 20, 16 << 20, 32 << 20), "concurrency": (2, 4, 8, 16)}


class RawParallel:
    """The parallel transfer done with aiobotocore alone: no checks, no error mapping."""

    def __init__(self, client: Any, bucket: str, part_size: int, concurrency: int) -> None:
        self.client = client
        self.bucket = bucket
        self.part_size = part_size
        self.concurrency = concurrency

    async def put(self, key: str, data: bytes) -> None:
        created = await self.client.create_multipart_upload(Bucket=self.bucket, Key=key)
        upload = created["UploadId"]
        parts: dict[int, str] = {}
        limiter = anyio.CapacityLimiter(self.concurrency)

        async def send(number: int, start: int, end: int) -> None:
            async with limiter:
                reply = await self.client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=number,
                    Body=data[start:end],
                )
            parts[number] = reply["ETag"]

        async with anyio.create_task_group() as group:
            for number, (start, end) in enumerate(part_ranges(len(data), self.part_size), 1):
                group.start_soon(send, number, start, end)
        await self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=key,
            UploadId=upload,
            MultipartUpload={"Parts": [{"ETag": parts[n], "PartNumber": n} for n in sorted(parts)]},
        )

    async def get(self, key: str) -> bytearray:
        head = await self.client.head_object(Bucket=self.bucket, Key=key)
        size = head["ContentLength"]
        buffer = bytearray(size)
        view = memoryview(buffer)
        limiter = anyio.CapacityLimiter(self.concurrency)

        async def fetch(start: int, end: int) -> None:
            async with limiter:
                response = await self.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
                )
                at = start
                async with response["Body"] as body:
                    async for chunk in body.iter_chunks(1 << 16):
                        view[at : at + len(chunk)] = chunk
                        at += len(chunk)

        async with anyio.create_task_group() as group:
            for start, end in part_ranges(size, self.part_size):
                group.start_soon(fetch, start, end)
        view.release()
        return buffer


class MailboxArm:
    def __init__(
        self, mailbox: S3Mailbox | LocalMailbox, size: int, chunk: int | None = None
    ) -> None:
        self.mailbox = mailbox
        self.size = size
        # LocalMailbox's write and read chunk for this arm (its single-hop path sets them
        # above the size).
        self.chunk = chunk

    async def put(self, key: str, data: bytes) -> None:
        saved = local_writes.WRITE_CHUNK
        if self.chunk is not None:
            local_writes.WRITE_CHUNK = self.chunk
        try:
            if not await self.mailbox.put_if_absent(key, data):
                raise RuntimeError(f"{key!r} existed before its put")
        finally:
            local_writes.WRITE_CHUNK = saved

    async def get(self, key: str) -> bytes:
        saved = local_reads.READ_CHUNK_BYTES
        if self.chunk is not None:
            local_reads.READ_CHUNK_BYTES = self.chunk
        try:
            # The size is known, as a blob's is from its reference.
            data = await self.mailbox.get(key, max_bytes=self.size)
        finally:
            local_reads.READ_CHUNK_BYTES = saved
        if data is None:
            raise RuntimeError(f"{key!r} is missing after its put")
        return data


async def _timed(op: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await op()
    return time.perf_counter() - started


async def _rounds(
    arms: dict[str, Any],
    data: bytes,
    repetitions: int,
    remove: Callable[[str, str], Awaitable[None]],
) -> dict[str, Any]:
    """Put then get ``data`` through each arm, ``repetitions`` times, the arms' order
    rotating, after one untimed warm-up round of every arm (connections, the page cache's
    first touch, the store's first object of that size); each object is removed (untimed)
    before the next arm runs."""
    names = list(arms)
    seconds: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": []} for n in names}
    for rep in range(-1, repetitions):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            arm, key = arms[name], f"blob/{name}-{rep + 1}"
            put = await _timed(partial(arm.put, key, data))

            async def get(arm: Any = arm, key: str = key) -> None:
                if len(await arm.get(key)) != len(data):
                    raise RuntimeError(f"{key!r} came back with the wrong size")

            got = await _timed(get)
            if rep >= 0:
                seconds[name]["put"].append(put)
                seconds[name]["get"].append(got)
            await remove(name, key)
            await anyio.to_thread.run_sync(os.sync)
    mib = len(data) / (1 << 20)
    figures: dict[str, Any] = {}
    for op in ("put", "get"):
        per_arm = {n: h.summary([mib / s for s in seconds[n][op]]) for n in names}
        medians = {n: per_arm[n]["median"] for n in names}
        figures[op] = {
            "mib_per_s": per_arm,
            "ratio_vs_single": h.ratio(medians["parallel"], medians["single"]),
            "ratio_vs_raw": h.ratio(medians["parallel"], medians["raw"]),
        }
    return figures


async def _s3(
    endpoint: str, bucket: str, data: bytes, repetitions: int, parts: dict[str, int]
) -> dict[str, Any]:
    """The S3 arms; ``parts`` overrides the ``parallel`` mailbox's part options."""
    from aiobotocore.session import get_session

    parallel = _patient(
        S3Mailbox(
            bucket, endpoint_url=endpoint, region="us-east-1", read_timeout=READ_TIMEOUT, **parts
        )
    )
    single = _patient(
        S3Mailbox(
            bucket,
            endpoint_url=endpoint,
            region="us-east-1",
            multipart_threshold=5 << 30,
            read_timeout=READ_TIMEOUT,
        )
    )
    async with (
        parallel,
        single,
        get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", config=parallel._config
        ) as client,
    ):
        arms = {
            "parallel": MailboxArm(parallel, len(data)),
            "single": MailboxArm(single, len(data)),
            "raw": RawParallel(client, bucket, parallel._part_size, parallel._part_concurrency),
        }

        async def remove(name: str, key: str) -> None:
            await client.delete_object(Bucket=bucket, Key=key)

        figures = await _rounds(arms, data, repetitions, remove)
    return figures | {
        "part_size": parallel._part_size,
        "part_concurrency": parallel._part_concurrency,
        "multipart_threshold": parallel._multipart_threshold,
    }


async def _local(scratch: Path, data: bytes, repetitions: int, chunk: int | None) -> dict[str, Any]:
    """The local arms; ``chunk`` (None: the mailbox's own) is the ``parallel`` arm's."""
    async with LocalMailbox(scratch / "mailbox") as mailbox:
        arms: dict[str, Any] = {
            "parallel": MailboxArm(mailbox, len(data), chunk=chunk),
            "single": MailboxArm(mailbox, len(data), chunk=len(data) + 1),
            "raw": FilesArm(scratch / "plain"),
        }

        async def remove(name: str, key: str) -> None:
            if name == "raw":
                await arms["raw"].remove([key])
            else:
                await mailbox.delete([key])

        figures = await _rounds(arms, data, repetitions, remove)
    return figures | {"write_chunk": chunk or local_writes.WRITE_CHUNK}


async def _sweep(endpoint: str, bucket: str, data: bytes) -> list[dict[str, Any]]:
    rows = []
    for part_size in SWEEP["part_size"]:
        for concurrency in SWEEP["concurrency"]:
            mailbox = _patient(
                S3Mailbox(
                    bucket,
                    endpoint_url=endpoint,
                    region="us-east-1",
                    part_size=part_size,
                    multipart_threshold=part_size,
                    part_concurrency=concurrency,
                    max_concurrency=max(8, concurrency),
                    read_timeout=READ_TIMEOUT,
                )
            )
            async with mailbox:
                key = f"sweep/{part_size}-{concurrency}"
                put = await _timed(partial(mailbox.put_if_absent, key, data))
                get = await _timed(partial(mailbox.get, key, max_bytes=len(data)))
                await mailbox.delete([key])
            mib = len(data) / (1 << 20)
            rows.append(
                {
                    "part_size": part_size,
                    "concurrency": concurrency,
                    "put_mib_per_s": mib / put,
                    "get_mib_per_s": mib / get,
                }
            )
            print(f"sweep part {part_size >> 20} MiB x{concurrency}: {rows[-1]}")
    return rows


def run(
    results: Path, quick: bool, size: int, sweep: bool, name: str = NAME, repetitions: int = 3
) -> Path:
    """Measure, write ``results/<name>.json`` and return its path."""
    repetitions = 1 if quick else repetitions
    parts, chunk = (QUICK_PARTS, QUICK_CHUNK) if quick else ({}, None)
    settings = {"size_bytes": size, "repetitions": repetitions, "sweep": sweep, "warm_up": True}
    result = h.header(name, quick=quick, parameters=settings)
    data = os.urandom(size)
    figures: dict[str, Any] = {}
    with h.aws_test_environment(), h.moto_server() as endpoint:
        bucket = h.create_bucket(endpoint)
        for backend in BACKENDS:
            with tempfile.TemporaryDirectory(prefix="gm-bench-transfer-") as scratch:
                local = anyio.run(_local, Path(scratch), data, repetitions, chunk, backend=backend)
            s3 = anyio.run(_s3, endpoint, bucket, data, repetitions, parts, backend=backend)
            figures[backend] = {"local": local, "s3": s3}
            print(backend, json.dumps(_ratios({backend: figures[backend]})))
        if sweep:
            sweep_size = min(size, SWEEP_SIZE)
            result["sweep"] = {
                "size_bytes": sweep_size,
                "rows": anyio.run(_sweep, endpoint, bucket, data[:sweep_size]),
            }
    result["figures"] = figures
    result["ratios"] = _ratios(figures)
    result["target_ratio_vs_raw"] = TARGET_RAW_RATIO
    result["load_average_1m_after"] = os.getloadavg()[0]
    return h.write_result(results, name, result)


def _ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """Every ratio, by loop, store and operation."""
    return {
        f"{backend} {store} {op}": {
            "vs_single": round(entry[op]["ratio_vs_single"], 3),
            "vs_raw": round(entry[op]["ratio_vs_raw"], 3),
        }
        for backend, stores in figures.items()
        for store, entry in stores.items()
        for op in ("put", "get")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 MiB, small parts, once")
    parser.add_argument("--large", action="store_true", help="1 GiB")
    parser.add_argument("--repetitions", type=int, default=3, help="of each arm")
    parser.add_argument("--sweep", action="store_true", help="also time part sizes/concurrency")
    parser.add_argument("--size", type=int, default=None, help="bytes in the blob")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    default = LARGE_SIZE if args.large else QUICK_SIZE if args.quick else SIZE
    size = args.size if args.size is not None else default
    name = f"{NAME}-large" if args.large else NAME
    path = run(args.results, args.quick, size, args.sweep, name, args.repetitions)
    result = json.loads(path.read_text())
    for where, ratios in result["ratios"].items():
        print(f"{where:22} vs single {ratios['vs_single']:.2f}  vs raw {ratios['vs_raw']:.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
