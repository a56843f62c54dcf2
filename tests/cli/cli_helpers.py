"""A run written into a real directory with the protocol's own encoders, and a CLI runner.

``write_run`` lays out what a run's nodes would have written after a few rounds (manifest,
Θ⁰, round records with their θ blobs, leases, an open round) without running nodes, so the
reading commands are tested against known content; the demo tests cover runs made by nodes.
"""

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.codec import digest, encode_fragment
from gradientmail.protocol.fragments import signature, window
from gradientmail.protocol.records import (
    BlobRef,
    Manifest,
    Participant,
    Rejection,
    RoundClaim,
    RoundRecord,
    RunConfig,
    Snapshot,
    encode,
)

FRAGMENTS = 3

InProcess = Callable[..., subprocess.CompletedProcess[str]]
"""The ``in_process`` fixture's runner: ``cli``'s arguments, ``cli.main`` in this process."""


@dataclass(frozen=True)
class WrittenRun:
    directory: Path
    manifest: Manifest
    records: dict[int, RoundRecord]
    newest: dict[str, torch.Tensor]
    """Every parameter's newest committed value by name."""


def cli(
    *args: str,
    timeout: float = 60,
    env_extra: dict[str, str] | None = None,
    **kwargs: object,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gradientmail ARGS`` (with ``env_extra`` in its environment) and
    capture its output."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "gradientmail", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        **kwargs,  # type: ignore[arg-type]
    )


async def write_run(directory: Path) -> WrittenRun:
    model = GPT(GPTConfig.tiny(), seed=1)
    config = RunConfig(fragments=FRAGMENTS, sync_every=8, update_encoding="int8")
    specs = signature(list(model.named_parameters()), FRAGMENTS, config.pattern)
    named = dict(model.named_parameters())
    async with LocalMailbox(directory) as mailbox:

        async def blob(tensors: Sequence[torch.Tensor], index: int) -> BlobRef:
            data = encode_fragment(tensors, specs[index], "fp32", block_size=config.block_size)
            await mailbox.put_if_absent(keys.blob(digest(data)), data)
            return BlobRef(sha256=digest(data), size=len(data), encoding="fp32")

        current = {name: p.detach().clone() for name, p in named.items()}
        theta0 = [
            await blob([window(current[p.name], p) for p in spec.params], spec.index)
            for spec in specs
        ]
        manifest = Manifest(created_by="alpha", config=config, fragments=specs, theta0=theta0)
        await mailbox.put_if_absent(keys.MANIFEST, encode(manifest))
        records = {}
        generator = torch.Generator().manual_seed(0)
        for round in range(5):
            fragment = keys.fragment_of(round, FRAGMENTS)
            spec = specs[fragment]
            for p in spec.params:
                current[p.name] = current[p.name].clone()
                window(current[p.name], p).add_(0.01 * torch.randn(p.shape, generator=generator))
            theta = await blob([window(current[p.name], p) for p in spec.params], fragment)
            record = RoundRecord(
                round=round,
                fragment=fragment,
                version=keys.version_of(round, FRAGMENTS),
                committed_by="alpha" if round % 2 else "beta",
                participants=(
                    Participant(learner="alpha", weight=0.75, steps=8, tokens=300, base_version=0),
                    Participant(learner="beta", weight=0.25, steps=8, tokens=100, base_version=0),
                ),
                rejected=(
                    (Rejection(learner="gamma", reason="non-finite", steps=8, tokens=50),)
                    if round == 3
                    else ()
                ),
                quorum_seconds=0.5,
                grace_seconds=0.25,
                cosine=0.9 if round != 2 else None,
                theta=theta,
                outer=theta,
                update=theta,
            )
            await mailbox.put_if_absent(keys.record(round), encode(record))
            records[round] = record
        for learner, beats in (("alpha", (3, 4)), ("beta", (7,))):
            for beat in beats:
                await mailbox.put_if_absent(keys.lease(learner, beat, "learner"), b"{}")
        delta = theta0[2]
        snapshot = Snapshot(
            learner="beta",
            round=5,
            fragment=2,
            base_version=1,
            steps=8,
            tokens=100,
            delta=delta,
            norm=1.0,
        )
        await mailbox.put_if_absent(keys.snapshot(5, "beta"), encode(snapshot))
        await mailbox.put_if_absent(keys.round_claim(5, 0), encode(RoundClaim(learner="alpha")))
    return WrittenRun(directory, manifest, records, current)
