"""``gradientmail.sync.open``: a node without a ``with`` block, closed by ``close()`` or at
the interpreter's exit (with flush, without after an uncaught exception, with flush after a
signal), in this process and in real script processes on a real directory."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from node_helpers import Recorder, Trainer, tiny_model
from sync_support import SOLO, check_holds_committed, committed, leases, wait_for

import gradientmail.sync
from gradientmail.events import Closed, Closing, StepsDropped

WORKER = Path(__file__).with_name("open_worker.py")
TESTS = Path(__file__).parents[1]
# A loaded machine may take tens of seconds to start a process and import torch.
START_LIMIT = 120.0


def _threads() -> set[threading.Thread]:
    """This process's threads but trio's idle workers (a process-wide cache of trio's)."""
    return {t for t in threading.enumerate() if not t.name.startswith("Trio thread")}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_close_flushes_and_leaves_no_thread(backend: str, tmp_path: Path) -> None:
    sink = Recorder()
    model = tiny_model()
    trainer = Trainer(model, seed=1)
    threads_before = _threads()
    node = gradientmail.sync.open(
        model,
        str(tmp_path),
        **SOLO,
        sinks=[sink],
        backend=backend,  # type: ignore[arg-type]
    )
    while node.state.rounds_committed < 3:
        trainer.step()
        node.step(tokens=16)
    assert "solo" in leases(tmp_path)
    node.close()
    node.close()
    assert [e for e in sink.events if isinstance(e, Closing)] == [Closing("solo", flushing=True)]
    assert sink.of(Closed)
    assert not sink.of(StepsDropped)
    assert leases(tmp_path) == {}
    check_holds_committed(tmp_path, model, node.state.versions)
    wait_for(lambda: _threads() <= threads_before, limit=10)
    with pytest.raises(RuntimeError, match="closed: step"):
        node.step(tokens=16)


def test_a_node_of_a_with_block_is_not_closed_by_close(tmp_path: Path) -> None:
    with (
        gradientmail.sync.node(tiny_model(), str(tmp_path), **SOLO) as node,
        pytest.raises(RuntimeError, match="with block"),
    ):
        node.close()


@pytest.mark.parametrize(
    ("backend", "ending", "signum", "returncode", "flushing"),
    [
        ("asyncio", "finish", None, 0, True),
        ("trio", "finish", None, 0, True),
        ("asyncio", "raise", None, 1, False),
        ("asyncio", "signal", signal.SIGTERM, 128 + signal.SIGTERM, True),
        ("trio", "signal", signal.SIGINT, -signal.SIGINT, True),
    ],
)
def test_a_script_that_never_closes_is_closed_at_exit(
    backend: str,
    ending: str,
    signum: signal.Signals | None,
    returncode: int,
    flushing: bool,
    tmp_path: Path,
) -> None:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(str(p) for p in (TESTS / "node", TESTS, TESTS.parent))
    }
    with subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), backend, ending],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            # readline blocks until the line or the end of the stream; the pytest timeout
            # bounds a worker that neither trains nor exits.
            while (line := process.stdout.readline()) not in ("training\n", ""):
                pass
            assert line == "training\n", f"worker did not train: {process.communicate()}"
            if signum is not None:
                process.send_signal(signum)
            stdout, stderr = process.communicate(timeout=START_LIMIT)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == returncode, stderr
    closing = [line for line in stdout.splitlines() if line.startswith("event Closing")]
    assert closing == [f"event Closing {flushing}"], stdout
    assert ("event Closed " in stdout.splitlines()) is flushing, stdout
    assert ("event StepsDropped " in stdout.splitlines()) is not flushing, stdout
    if ending != "raise" and signum != signal.SIGINT:
        assert "Traceback" not in stderr, stderr
    assert leases(tmp_path) == {}, "the lease outlived the process"
    assert len(committed(tmp_path)) >= 3
