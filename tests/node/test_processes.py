"""Three nodes in three processes share a directory (LocalMailbox), two under trio and one
under asyncio."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import safetensors.torch
from node_helpers import assert_holds_committed, assert_steps_accounted, records, tiny_model

from gradientmail.events import StepsDropped
from gradientmail.mailbox import LocalMailbox

WORKER = Path(__file__).with_name("node_worker.py")
LEARNERS = (("p1", "trio"), ("p2", "asyncio"), ("p3", "trio"))
UNTIL_ROUND = 6
# Start-up, the barrier (itself bounded in the worker) and the rounds, on a loaded machine.
DEADLINE = 270.0


def test_three_processes_train_one_model_in_a_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(WORKER.parent), str(WORKER.parents[1]))),
        "OMP_NUM_THREADS": "1",
    }
    started = time.monotonic()
    workers: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for seed, (learner, backend) in enumerate(LEARNERS):
            # A file rather than a pipe: nobody reads a pipe while another process is awaited.
            with (tmp_path / f"{learner}.stderr").open("wb") as stderr:
                workers[learner] = subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        str(run),
                        learner,
                        str(seed),
                        str(UNTIL_ROUND),
                        backend,
                        str(out),
                        str(len(LEARNERS)),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
        for learner, process in workers.items():
            process.wait(timeout=max(1.0, DEADLINE - (time.monotonic() - started)))
            stderr_text = (tmp_path / f"{learner}.stderr").read_text(errors="replace")
            assert process.returncode == 0, f"{learner}: {stderr_text[-4000:]}"
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    anyio.run(check, run, out)


async def check(run: Path, out: Path) -> None:
    box = LocalMailbox(run)
    history = await records(box)
    assert len(history) >= UNTIL_ROUND + 1
    assert {p.learner for r in history for p in r.participants} == {"p1", "p2", "p3"}
    for learner, _ in LEARNERS:
        report = json.loads((out / f"{learner}.json").read_text())
        assert report["met"] == ["p1", "p2", "p3"], f"{learner} left the barrier early"
        model = tiny_model()
        model.load_state_dict(safetensors.torch.load_file(str(out / f"{learner}.safetensors")))
        await assert_holds_committed(box, model, report["versions"])
        drops = [
            StepsDropped(learner, d["fragment"], d["steps"], d["tokens"], "")
            for d in report["drops"]
        ]
        assert_steps_accounted(learner, report["steps"], report["tokens"], drops, history)
