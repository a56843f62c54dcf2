"""Launching the group tests' worker processes (``group_worker.py``), as torchrun would:
one process per rank, each told its rank, the group's size and its rendezvous port; and the
checks the DDP and FSDP2 tests share.

The ranks are real processes forked from a server that imported torch and gradientmail once
(``forked``).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import safetensors.torch
from forked import Forked
from node_helpers import assert_holds_committed, assert_steps_accounted, records, tiny_model
from torch import nn

from gradientmail.events import StepsDropped
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol.records import RoundRecord

WORKER = Path(__file__).with_name("group_worker.py")
TESTS = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def torchrun(script: Path, *arguments: str, env: dict[str, str] | None = None) -> Any:
    """Run ``script`` under ``torchrun`` with two processes on this machine (the completed
    process, its output captured)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        # Each rank's output through torchrun, a line at a time (prefixed with the rank): the
        # ranks writing to one pipe themselves can run their lines together.
        "--tee=3",
        str(script),
        *arguments,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=240, check=False, env=env
    )


def launch(
    script: Path, *arguments: str, world: int = 2, env: dict[str, str] | None = None
) -> list[tuple[int, str]]:
    """Run ``script`` as ``world`` ranks started at once with the environment torchrun gives
    them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the rendezvous address), without
    torchrun's own process; each rank's exit status and output (standard output and error),
    once all exited."""
    port = str(free_port())
    with tempfile.TemporaryDirectory() as outputs:
        processes = [
            Forked(
                script,
                list(arguments),
                {
                    **(env if env is not None else os.environ),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world),
                },
                Path(outputs) / f"{rank}.output",
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + 240
        try:
            codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return [(code, process.read()) for code, process in zip(codes, processes, strict=True)]


@dataclass
class Ranks:
    """The worker processes of one test, by ``learner.rank``."""

    tmp: Path

    def __post_init__(self) -> None:
        self.run = self.tmp / "run"
        self.out = self.tmp / "out"
        self.out.mkdir(exist_ok=True)
        self.processes: dict[str, Forked] = {}

    def start(
        self,
        learner: str,
        world: int,
        how: str,
        *,
        scenario: str = "train",
        parties: int = 1,
        until: int = 8,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start every rank of ``learner``'s group (one process when ``world`` is 1)."""
        port = str(free_port())
        environment = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(TESTS / "node"), str(TESTS), str(TESTS.parent))),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        for rank in range(world):
            name = f"{learner}.{rank}"
            self.processes[name] = Forked(
                WORKER,
                [
                    str(self.run),
                    learner,
                    str(rank),
                    str(world),
                    port,
                    how,
                    scenario,
                    str(self.out),
                    str(parties),
                    str(until),
                ],
                environment,
                self.tmp / f"{name}.output",
            )

    def train_together(
        self,
        learners: tuple[tuple[str, int, str], ...],
        until: int,
        limit: float,
        env: dict[str, str] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Start every rank of every ``(learner, world, how)`` (meeting before their first
        step), training until round ``until``; every rank's report, by ``learner.rank``,
        once all exited 0 within ``limit`` seconds."""
        for learner, world, how in learners:
            self.start(learner, world, how, parties=len(learners), until=until, env=env)
        deadline = time.monotonic() + limit
        return {
            f"{learner}.{rank}": self.wait(f"{learner}.{rank}", deadline)
            for learner, world, _ in learners
            for rank in range(world)
        }

    def wait(self, name: str, deadline: float) -> dict[str, Any]:
        """Wait for ``name`` (``learner.rank``) to exit 0 by ``deadline`` (monotonic); its
        report."""
        process = self.processes[name]
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert process.returncode == 0, f"{name}: {process.read()[-4000:]}"
        report: dict[str, Any] = json.loads((self.out / f"{name}.json").read_text())
        return report

    def wait_for_file(self, path: Path, deadline: float) -> None:
        while not path.exists():
            assert time.monotonic() < deadline, f"{path.name} did not appear"
            for name, process in self.processes.items():
                code = process.poll()
                if code is not None and code != 0:
                    raise AssertionError(f"{name} exited {code}: {process.read()[-4000:]}")
            time.sleep(0.02)

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def load_rank(out: Path, name: str, hidden: int = 16) -> nn.Module:
    """The final weights ``name`` (``learner.rank``) wrote, in a fresh ``tiny_model``."""
    model = tiny_model(hidden=hidden)
    model.load_state_dict(safetensors.torch.load_file(str(out / f"{name}.safetensors")))
    return model


async def check_run(
    run: Path, out: Path, reports: dict[str, dict[str, Any]], rounds: int, hidden: int = 16
) -> list[RoundRecord]:
    """The run's records (at least ``rounds``, every reporting learner among their
    participants), each rank's final weights the committed θ of its versions, and each
    leader's steps accounted for; the records."""
    box = LocalMailbox(run)
    history = await records(box)
    assert len(history) >= rounds
    learners = {name.split(".")[0] for name in reports}
    assert {p.learner for r in history for p in r.participants} == learners
    for name, report in reports.items():
        learner = name.split(".")[0]
        await assert_holds_committed(box, load_rank(out, name, hidden), report["versions"])
        if name.endswith(".0"):
            drops = [
                StepsDropped(learner, d["fragment"], d["steps"], d["tokens"], "")
                for d in report["drops"]
            ]
            assert_steps_accounted(learner, report["steps"], report["tokens"], drops, history)
    return history


def kill_and_rejoin(
    ranks: Ranks, how: str, limit: float, env: dict[str, str] | None = None, hidden: int = 16
) -> list[dict[str, Any]]:
    """Group ``g1`` (started with ``scenario="kill"``) loses rank 1 to SIGKILL: its leader
    fails at once; restarted, the group rejoins the run (``how``) and both ranks end on the
    committed θ of the same versions (each life within ``limit`` seconds). The restarted
    ranks' reports."""
    deadline = time.monotonic() + limit
    ranks.wait_for_file(ranks.out / "g1.stepping", deadline)
    killed_at = time.time()
    ranks.processes["g1.1"].send_signal(signal.SIGKILL)
    ranks.processes["g1.1"].wait()
    leader = ranks.wait("g1.0", deadline)
    assert leader["raised"] == "GroupFailed", leader["message"]
    # A dead peer closes its connections: the leader fails at once, not after the timeout.
    assert leader["at"] - killed_at < 20.0
    first_life = anyio.run(records, LocalMailbox(ranks.run))

    ranks.start("g1", 2, how, until=len(first_life) + 4, env=env)
    deadline = time.monotonic() + limit
    again = [ranks.wait(f"g1.{rank}", deadline) for rank in range(2)]
    assert [r["raised"] for r in again] == [None, None]
    assert again[0]["versions"] == again[1]["versions"]
    assert again[0]["mismatches"] == again[1]["mismatches"] == 0

    async def rejoined() -> None:
        box = LocalMailbox(ranks.run)
        history = await records(box)
        later = history[len(first_life) :]
        assert any(p.learner == "g1" for r in later for p in r.participants)
        for rank in range(2):
            model = load_rank(ranks.out, f"g1.{rank}", hidden)
            await assert_holds_committed(box, model, again[rank]["versions"])

    anyio.run(rejoined)
    return again
