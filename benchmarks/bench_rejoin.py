"""Rejoin: how long a new learner takes to join a run whose fragments are past version 20,
against the raw time to read the bytes it needs, with ``checkpoint_every`` 1 and the default.

A run of a ``P``-parameter model (``--mib``: its size in fp32; 64 MiB by default, for the
full benchmark run; ``--large`` is the issue's 1 GiB, 268M parameters, about 6 minutes on
two cores, most of it writing the run into moto, written to ``rejoin-large.json``, which
the page prefers: ``nox -s bench-large``) is written
straight into the store as the syncer leaves it after garbage collection
(``checkpoint.retained``): every round record, the blobs of the records that are kept (int8
updates; θ and the momentum at checkpoints), nothing else. A fresh node then joins
(``gradientmail.node``, learner only) and the time until it holds the newest version of
every fragment is measured: ``RunReader.rebuild`` loads the checkpoint at or below each
fragment's version and applies the updates after it. The raw baseline reads exactly the
blobs the rebuild reads, with the same mailbox, one after the other, and decodes nothing.

Both stores: a ``LocalMailbox`` directory and an ``S3Mailbox`` on a moto server on
127.0.0.1. Fragments end at version ``VERSION`` (21: with ``checkpoint_every`` 8 the newest
checkpoint is 16 and five updates follow it; 4 on average over where a join lands, 7 at
worst). Each measurement is repeated, interleaved, and the median reported.

Usage: ``.venv/bin/python benchmarks/bench_rejoin.py [--quick] [--mib N] [--results DIR]``.
"""

import argparse
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import _harness as h
import anyio
import msgspec
import torch
from torch import nn

from gradientmail._node import NodeOptions
from gradientmail._node import node as open_node
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import base, is_checkpoint, retained
from gradientmail.protocol.codec import encode_fragment
from gradientmail.protocol.fragments import signature
from gradientmail.protocol.outer import apply_update
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    Manifest,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
)
from gradientmail.store import Store

NAME = "rejoin"
FRAGMENTS = 4
VERSION = 21
WIDTH = 1024
LARGE_MIB = 1024
EVERY = (1, RunConfig().checkpoint_interval)
OPTIONS = NodeOptions(poll_interval=0.05, lease_every=1.0, lease_timeout=10.0, syncer=False)


def plan(quick: bool, mib: int) -> dict[str, Any]:
    if quick:
        return {"mib": 4, "repetitions": 1, "version": VERSION}
    return {"mib": mib, "repetitions": 3, "version": VERSION}


def model_of(mib: int) -> nn.Module:
    """Square bias-free layers of ``WIDTH``: ``mib`` MiB of fp32 parameters."""
    layers = max(FRAGMENTS, mib * (1 << 20) // (4 * WIDTH * WIDTH))
    torch.manual_seed(0)
    with torch.no_grad():
        return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))


def _draft(round: int, version: int, fragment: int) -> RoundRecordDraft:
    return RoundRecordDraft(
        round=round, fragment=fragment, version=version, committed_by="bench",
        participants=(), quorum_seconds=0.0, grace_seconds=0.0, cosine=None,
    )  # fmt: skip


async def _fp32(store: Store, tensors: list[torch.Tensor], spec: FragmentSpec) -> BlobRef:
    return await store.put_blob(encode_fragment(tensors, spec, "fp32", block_size=1), "fp32")


async def _fragment(
    store: Store, spec: FragmentSpec, config: RunConfig, kept: frozenset[int]
) -> None:
    """Every record of ``spec``'s fragment up to ``VERSION``: the kept ones with their
    blobs (a random θ at the oldest kept checkpoint, random int8 updates after it, θ and a
    momentum at every checkpoint), the others naming blobs that are gone (collected)."""
    count = config.fragments
    gen = torch.Generator().manual_seed(spec.index)
    rounds = [keys.round_of(spec.index, v, count) for v in range(1, VERSION + 1)]
    first = min(r for r in rounds if r in kept)
    theta = [torch.randn(p.shape, generator=gen) for p in spec.params]
    gone = await store.put_blob(b"collected", "int8")
    for version, round in enumerate(rounds, start=1):
        draft = _draft(round, version, spec.index)
        if round not in kept:
            theta_ref = gone if is_checkpoint(version, config) else None
            record = RoundRecord.committed(draft, update=gone, theta=theta_ref, outer=theta_ref)
            await store.put_record(record)
            continue
        step = [torch.randn(p.shape, generator=gen) * 1e-3 for p in spec.params]
        update = encode_fragment(step, spec, "int8", block_size=config.block_size)
        if round != first:
            theta = apply_update(theta, update, spec)
        refs = {}
        if is_checkpoint(version, config):
            momentum = [torch.randn(p.shape, generator=gen) for p in spec.params]
            refs = {
                "theta": await store.put_blob(
                    encode_fragment(theta, spec, "fp32", block_size=1), "fp32"
                ),
                "outer": await store.put_blob(
                    encode_fragment(momentum, spec, "fp32", block_size=1), "fp32"
                ),
            }
        update_ref = await store.put_blob(update, "int8")
        await store.put_record(RoundRecord.committed(draft, update=update_ref, **refs))


async def build(box: Mailbox, model: nn.Module, every: int) -> RunConfig:
    """The run of ``model`` in ``box`` at ``VERSION`` with ``checkpoint_every`` ``every``."""
    config = RunConfig(
        fragments=FRAGMENTS, sync_every=64, checkpoint_every=every,
        delta_encoding="int8", update_encoding="int8",
    )  # fmt: skip
    store = Store(box)
    specs = signature(list(model.named_parameters()), FRAGMENTS, config.pattern)
    theta0 = []
    for spec in specs:
        tensors = [torch.zeros(p.shape) for p in spec.params]
        theta0.append(
            await store.put_blob(encode_fragment(tensors, spec, "fp32", block_size=1), "fp32")
        )
    await store.create_manifest(
        Manifest(created_by="bench", config=config, fragments=specs, theta0=tuple(theta0))
    )
    kept = retained(VERSION * FRAGMENTS - 1, config).records
    for spec in specs:
        await _fragment(store, spec, config, kept)
    return config


async def needed(box: Mailbox, config: RunConfig) -> list[str]:
    """The blob keys a joiner's rebuild reads: per fragment the θ at ``base(VERSION)`` and
    the updates after it."""
    store = Store(box)
    found = []
    for fragment in range(config.fragments):
        start = base(VERSION, config)
        for version in range(start, VERSION + 1):
            record = await store.record(keys.round_of(fragment, version, config.fragments))
            assert record is not None
            ref = record.theta if version == start else record.update
            assert ref is not None
            found.append(keys.blob(ref.sha256))
    return found


async def join(box: Mailbox, model: nn.Module) -> float:
    """Seconds for a fresh learner to join: from opening the node to holding θ."""
    started = time.perf_counter()
    async with open_node(model, box, learner=f"joiner-{time.monotonic_ns()}", options=OPTIONS):
        return time.perf_counter() - started


async def raw(box: Mailbox, blobs: list[str]) -> tuple[float, int]:
    """Seconds to read ``blobs`` one after the other, and their bytes."""
    started = time.perf_counter()
    size = 0
    for key in blobs:
        data = await box.get(key)
        assert data is not None
        size += len(data)
    return time.perf_counter() - started, size


async def measure(
    opened: Callable[[], Any], model: nn.Module, every: int, repetitions: int
) -> dict[str, Any]:
    """Build the run in the mailbox ``opened()`` gives, then time joins and raw reads."""
    async with opened() as box:
        began = time.perf_counter()
        config = await build(box, model, every)
        built = time.perf_counter() - began
        blobs = await needed(box, config)
        joins: list[float] = []
        raws: list[float] = []
        size = 0
        for _ in range(repetitions):
            seconds, size = await raw(box, blobs)
            raws.append(seconds)
            joins.append(await join(box, model))
    return {
        "checkpoint_every": every,
        "join_seconds": h.summary(joins),
        "raw_seconds": h.summary(raws),
        "join_over_raw": h.summary([j / r for j, r in zip(joins, raws, strict=True)]),
        "bytes_read": size,
        "blobs_read": len(blobs),
        "build_seconds": built,
    }


def _local(scratch: Path) -> Callable[[], Any]:
    counter = iter(range(1000))

    def opened() -> Any:
        return LocalMailbox(scratch / f"store-{next(counter)}")

    return opened


def _s3(endpoint: str) -> Callable[[], Any]:
    @asynccontextmanager
    async def opened() -> AsyncIterator[Mailbox]:
        bucket = await anyio.to_thread.run_sync(h.create_bucket, endpoint)
        async with S3Mailbox(bucket, endpoint_url=endpoint, region="us-east-1") as box:
            yield box

    return opened


def run(
    results: Path, quick: bool, mib: int, name: str = NAME, log: Callable[[str], None] = print
) -> Path:
    settings = plan(quick, mib)
    model = model_of(settings["mib"])
    params = sum(p.numel() for p in model.parameters())
    figures: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="gm-bench-rejoin-") as scratch,
        h.aws_test_environment(),
        h.moto_server() as endpoint,
    ):
        stores: dict[str, Callable[[], Any]] = {
            "local": _local(Path(scratch)),
            "s3": _s3(endpoint),
        }
        for name, opened in stores.items():
            figures[name] = {}
            for every in EVERY:
                entry = _run(measure, opened, model, every, settings["repetitions"])
                figures[name][str(every)] = entry
                log(
                    f"  {name} checkpoint_every {every}: join "
                    f"{entry['join_seconds']['median']:.2f} s, raw read "
                    f"{entry['raw_seconds']['median']:.2f} s of "
                    f"{entry['bytes_read'] / 2**20:.0f} MiB"
                )
    parameters = settings | {
        "params": params, "fragments": FRAGMENTS, "checkpoint_every": list(EVERY),
        "update_encoding": "int8",
    }  # fmt: skip
    result = h.header(name, quick=quick, parameters=parameters)
    result["figures"] = figures
    return h.write_result(results, name, result)


def _run(fn: Callable[..., Awaitable[dict[str, Any]]], *args: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        return await fn(*args)

    return anyio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4 MiB model, one repetition")
    parser.add_argument("--mib", type=int, default=64, help="the model's fp32 size in MiB")
    parser.add_argument("--large", action="store_true", help="1 GiB, to rejoin-large.json")
    parser.add_argument("--results", type=Path, default=h.RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    if args.large:
        path = run(args.results, False, LARGE_MIB, f"{NAME}-large")
    else:
        path = run(args.results, args.quick, args.mib)
    print(json.dumps(msgspec.json.decode(path.read_bytes())["figures"], indent=1)[:4000])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
