"""Launching the group tests' worker processes (``group_worker.py``), as torchrun would:
one process per rank, each told its rank, the group's size and its rendezvous port."""

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        str(script),
        *arguments,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=240, check=False, env=env
    )


@dataclass
class Ranks:
    """The worker processes of one test, by ``learner.rank``."""

    tmp: Path

    def __post_init__(self) -> None:
        self.run = self.tmp / "run"
        self.out = self.tmp / "out"
        self.out.mkdir(exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

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
            # A file rather than a pipe: nobody reads a pipe while another process is awaited.
            with (self.tmp / f"{name}.stderr").open("wb") as stderr:
                self.processes[name] = subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
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
                    env=environment,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )

    def wait(self, name: str, deadline: float) -> dict[str, Any]:
        """Wait for ``name`` (``learner.rank``) to exit 0 by ``deadline`` (monotonic); its
        report."""
        process = self.processes[name]
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
        stderr = (self.tmp / f"{name}.stderr").read_text(errors="replace")
        assert process.returncode == 0, f"{name}: {stderr[-4000:]}"
        report: dict[str, Any] = json.loads((self.out / f"{name}.json").read_text())
        return report

    def wait_for_file(self, path: Path, deadline: float) -> None:
        while not path.exists():
            assert time.monotonic() < deadline, f"{path.name} did not appear"
            for name, process in self.processes.items():
                code = process.poll()
                if code is not None and code != 0:
                    stderr = (self.tmp / f"{name}.stderr").read_text(errors="replace")
                    raise AssertionError(f"{name} exited {code}: {stderr[-4000:]}")
            time.sleep(0.02)

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
