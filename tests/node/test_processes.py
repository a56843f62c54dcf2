"""Three nodes in three processes share a directory (LocalMailbox), two under trio and one
under asyncio."""

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import safetensors.torch
from node_helpers import assert_holds_committed, assert_steps_accounted, records, tiny_model

from gradientmail.events import StepsDropped
from gradientmail.mailbox import LocalMailbox

WORKER = Path(__file__).with_name("node_worker.py")


def test_three_processes_train_one_model_in_a_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent), "OMP_NUM_THREADS": "1"}
    workers = {
        learner: subprocess.Popen(
            [sys.executable, str(WORKER), str(run), learner, str(seed), "20", backend, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for seed, (learner, backend) in enumerate(
            (("p1", "trio"), ("p2", "asyncio"), ("p3", "trio"))
        )
    }
    try:
        for learner, process in workers.items():
            _, stderr = process.communicate(timeout=240)
            assert process.returncode == 0, f"{learner}: {stderr.decode()[-4000:]}"
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    anyio.run(check, run, out)


async def check(run: Path, out: Path) -> None:
    box = LocalMailbox(run)
    history = await records(box)
    assert len(history) >= 21
    assert {p.learner for r in history for p in r.participants} == {"p1", "p2", "p3"}
    for learner in ("p1", "p2", "p3"):
        report = json.loads((out / f"{learner}.json").read_text())
        model = tiny_model()
        model.load_state_dict(safetensors.torch.load_file(str(out / f"{learner}.safetensors")))
        await assert_holds_committed(box, model, report["versions"])
        drops = [
            StepsDropped(learner, d["fragment"], d["steps"], d["tokens"], "")
            for d in report["drops"]
        ]
        assert_steps_accounted(learner, report["steps"], report["tokens"], drops, history)
