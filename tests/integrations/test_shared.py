"""The shared model for synchronous and async users: ``Node.shared_model`` (the run's newest
committed weights, not the learner's own), ``gradientmail.sync.load`` and
``gradientmail.sync.Barrier`` (two real processes on a real directory)."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
from node_helpers import CONFIG, Trainer, assert_holds_committed, records, tiny_model
from sync_support import SOLO, check_holds_committed, committed, wait_for
from torch import nn

import gradientmail
import gradientmail.sync
from gradientmail.errors import RunMismatch
from gradientmail.mailbox import LocalMailbox

TESTS = Path(__file__).parents[1]
# A loaded machine may take tens of seconds to start a process and import torch.
START_LIMIT = 120.0
BARRIER = """
import sys
import gradientmail.sync
sys.stdin.readline()
barrier = gradientmail.sync.Barrier(sys.argv[1], sys.argv[2], poll_interval=0.02)
print(sorted(barrier.wait("go", parties=2)), flush=True)
"""


def _newest(found: list[gradientmail.protocol.records.RoundRecord]) -> tuple[int, ...]:
    versions = [0] * CONFIG.fragments
    for record in found:
        versions[record.fragment] = max(versions[record.fragment], record.version)
    return tuple(versions)


def _read_steadily(
    read: Callable[[], object], newest: Callable[[], tuple[int, ...]]
) -> tuple[int, ...]:
    """Call ``read`` until no round was committed during it; the newest versions then."""
    found: list[tuple[int, ...]] = []

    def steady() -> bool:
        before = newest()
        read()
        found.append(newest())
        return found[-1] == before

    wait_for(steady)
    return found[-1]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sync_shared_model_is_the_newest_committed_not_the_local_one(
    backend: str, tmp_path: Path
) -> None:
    model = tiny_model()
    trainer = Trainer(model, seed=1)
    shared = tiny_model(seed=7)
    with gradientmail.sync.node(
        model,
        str(tmp_path),
        **SOLO,
        backend=backend,  # type: ignore[arg-type]
    ) as node:
        while node.state.rounds_committed < 3:
            trainer.step()
            node.step(tokens=16)
        trainer.step()
        assert node.shared_model(into=shared) is shared
        state: dict[str, torch.Tensor] = {}
        versions = _read_steadily(
            lambda: (state.update(node.shared_model()), node.shared_model(into=shared)),
            lambda: _newest(committed(tmp_path)),
        )
        with pytest.raises(RunMismatch):
            node.shared_model(into=nn.Linear(3, 3))
    check_holds_committed(tmp_path, shared, versions)
    assert set(state) == {name for name, _ in model.named_parameters()}
    for name, value in shared.named_parameters():
        assert torch.equal(state[name], value.detach())
    assert any(
        not torch.equal(dict(model.named_parameters())[name].detach(), value)
        for name, value in state.items()
    ), "the local model had not moved away from the shared one"


@pytest.mark.anyio
async def test_async_shared_model_is_the_newest_committed(tmp_path: Path) -> None:
    model = tiny_model()
    trainer = Trainer(model, seed=1)
    shared = tiny_model(seed=7)
    mailbox = LocalMailbox(tmp_path)
    async with gradientmail.node(model, str(tmp_path), **SOLO) as node:
        while node.state.rounds_committed < 3:
            trainer.step()
            await node.step(tokens=16)
        while True:
            before = _newest(await records(mailbox))
            await node.shared_model(into=shared)
            if _newest(await records(mailbox)) == before:
                break
            await anyio.sleep(0.01)
    await assert_holds_committed(mailbox, shared, before)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sync_load_puts_the_newest_committed_weights_into_a_model(
    backend: str, tmp_path: Path
) -> None:
    model = tiny_model()
    trainer = Trainer(model, seed=1)
    node = gradientmail.sync.open(model, str(tmp_path), **SOLO)
    while node.state.rounds_committed < 3:
        trainer.step()
        node.step(tokens=16)
    node.close()
    loaded = tiny_model(seed=7)
    sources = gradientmail.sync.load(str(tmp_path), loaded, backend=backend)  # type: ignore[arg-type]
    versions = tuple(source.version for source in sources)
    assert versions == _newest(committed(tmp_path))
    check_holds_committed(tmp_path, loaded, versions)
    with pytest.raises(RunMismatch):
        gradientmail.sync.load(str(tmp_path), nn.Linear(3, 3))


def test_sync_barrier_holds_two_processes_until_both_arrived(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(TESTS.parent)}

    def start(learner: str) -> subprocess.Popen[str]:
        # Each waits for a line on its standard input before it arrives: both start (and
        # import) at once, and "b" arrives only once "a" is seen waiting.
        return subprocess.Popen(
            [sys.executable, "-c", BARRIER, str(tmp_path), learner],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )

    async def arrived() -> list[str]:
        async with LocalMailbox(tmp_path) as mailbox:
            return list(await mailbox.list("barriers/go/"))

    first, second = start("a"), start("b")
    try:
        assert first.stdin is not None
        first.stdin.write("\n")
        first.stdin.flush()
        wait_for(lambda: first.poll() is not None or anyio.run(arrived) != [], START_LIMIT)
        assert first.poll() is None, first.communicate()
        assert second.poll() is None, second.communicate()
        assert second.stdin is not None
        second.stdin.write("\n")
        second.stdin.flush()
        outputs = [p.communicate(timeout=START_LIMIT) for p in (first, second)]
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    assert [out for out, _ in outputs] == ["['a', 'b']\n"] * 2


def test_sync_barrier_times_out_alone(tmp_path: Path) -> None:
    barrier = gradientmail.sync.Barrier(str(tmp_path), "a", poll_interval=0.02)
    with pytest.raises(TimeoutError, match="1 of 2"):
        barrier.wait("go", parties=2, timeout=0.2)
    with pytest.raises(ValueError, match="learner"):
        gradientmail.sync.Barrier(str(tmp_path), "a/b")
