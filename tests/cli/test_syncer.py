"""``gradientmail syncer``: a syncer-only process closes the rounds of learners that have no
syncer of their own, prints its events as JSON lines, and stops cleanly on SIGTERM."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import torch

from gradientmail._node import NodeOptions, node
from gradientmail.demo.data import synthetic
from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import RoundRecord, RunConfig, decode

STEPS = 16


async def _train_without_a_syncer(store: Path) -> None:
    torch.set_num_threads(1)
    corpus = synthetic(length=16)
    model = GPT(GPTConfig.tiny(context=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = corpus.train(0, batch_size=4, length=16)
    options = NodeOptions(
        syncer=False, poll_interval=0.1, lease_every=0.5, lease_timeout=3.0, close_timeout=60.0
    )
    config = RunConfig(fragments=2, sync_every=4, grace=0.5)
    async with node(model, str(store), learner="trainer", config=config, options=options) as n:
        for _ in range(STEPS):
            loss = model.loss(next(batches))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            await n.step(tokens=4 * 16)


async def _records(store: Path) -> list[RoundRecord]:
    async with LocalMailbox(store) as mailbox:
        found = []
        for key in await mailbox.list(keys.RECORDS):
            data = await mailbox.get(key)
            assert data is not None
            found.append(decode(data, RoundRecord))
        return found


def test_syncer_closes_rounds_for_learners_and_stops_on_sigterm(tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "gradientmail", "syncer", str(store), "--learner", "host-s",
               "--backend", "trio"]  # fmt: skip
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as syncer:
        try:
            anyio.run(_train_without_a_syncer, store)
            syncer.send_signal(signal.SIGTERM)
            stdout, stderr = syncer.communicate(timeout=30)
        finally:
            if syncer.poll() is None:
                syncer.kill()
    assert syncer.returncode == 0, stderr
    assert "Traceback" not in stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    assert {e["learner"] for e in events} == {"host-s"}
    kinds = [e["event"] for e in events]
    assert "joined" in kinds
    assert "round_committed" in kinds
    assert "lease_released" in kinds
    records = anyio.run(_records, store)
    assert len(records) >= 4
    assert {r.committed_by for r in records} == {"host-s"}
    assert [r.round for r in records] == list(range(len(records)))
    # Every local step reaches a round once per fragment.
    assert sum(p.steps for r in records for p in r.participants) == 2 * STEPS
    leases = anyio.run(_leases, store)
    assert leases == []


async def _leases(store: Path) -> list[str]:
    async with LocalMailbox(store) as mailbox:
        return list(await mailbox.list(keys.LEASES))
