"""``gradientmail syncer``: a syncer-only process closes the rounds of learners that have no
syncer of their own, prints its events as JSON lines, and stops cleanly on SIGTERM; with
``--trusted-loss MODULE:NAME`` it screens them with that function."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
from cli_helpers import InProcess

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


JUDGE = """
import torch
from gradientmail.demo.data import evaluate, synthetic
from gradientmail.demo.model import GPT, GPTConfig

MODEL = GPT(GPTConfig.tiny(context=16))
BATCHES = [next(synthetic(length=16).train(99, batch_size=8, length=16))]


def loss(state):
    with open("calls", "a") as calls:
        calls.write("1\\n")
    MODEL.load_state_dict(state, strict=False)
    return evaluate(MODEL, BATCHES)
"""


def _serve(store: Path, cwd: Path, *extra: str) -> tuple[str, str, int]:
    """``gradientmail syncer`` on ``store`` (run from ``cwd``) while a learner trains, then
    SIGTERM: its stdout, stderr and exit status."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "gradientmail", "syncer", str(store), "--learner", "host-s",
               "--backend", "trio", *extra]  # fmt: skip
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    ) as syncer:
        try:
            anyio.run(_train_without_a_syncer, store)
            syncer.send_signal(signal.SIGTERM)
            stdout, stderr = syncer.communicate(timeout=30)
        finally:
            if syncer.poll() is None:
                syncer.kill()
    return stdout, stderr, syncer.returncode


def test_syncer_closes_rounds_for_learners_and_stops_on_sigterm(tmp_path: Path) -> None:
    store = tmp_path / "store"
    stdout, stderr, status = _serve(store, tmp_path)
    assert status == 0, stderr
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


def test_a_syncer_with_a_trusted_loss_scores_every_round_it_closes(tmp_path: Path) -> None:
    """The function ``--trusted-loss`` names, from a module in the directory the syncer runs
    in, is called once for each round's committed θ and once per delta (here one learner's),
    and every step is still committed."""
    (tmp_path / "judge_module.py").write_text(JUDGE)
    store = tmp_path / "store"
    _, stderr, status = _serve(store, tmp_path, "--trusted-loss", "judge_module:loss")
    assert status == 0, stderr
    records = anyio.run(_records, store)
    screened = [r for r in records if r.participants or r.rejected]
    calls = len((tmp_path / "calls").read_text().splitlines())
    assert calls >= 2 * len(screened) >= 8, (calls, len(screened))
    assert all(rejection.reason == "loss" for r in records for rejection in r.rejected)
    counted = sum(p.steps for r in records for p in r.participants)
    dropped = sum(x.steps for r in records for x in r.rejected)
    assert counted + dropped == 2 * STEPS


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_colon", "takes MODULE:NAME"),
        ("no_such_module_here:loss", "does not import: ModuleNotFoundError"),
        ("json:no_such_function", "has no 'no_such_function'"),
        ("json:__doc__", "has a non-callable '__doc__'"),
    ],
)
def test_a_trusted_loss_that_cannot_be_used_is_exit_1_naming_why(
    tmp_path: Path, in_process: InProcess, spec: str, says: str
) -> None:
    result = in_process("syncer", str(tmp_path / "store"), "--trusted-loss", spec)
    assert result.returncode == 1, result
    assert says in result.stderr, result.stderr
    assert not (tmp_path / "store").exists(), "a refused syncer must not touch the store"
