"""``handle_signals=True``: SIGTERM and SIGINT sent to a real training process close its node
without flush, release its lease, and end the process without a traceback."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sync_support import committed, leases

WORKER = Path(__file__).with_name("signal_worker.py")
TESTS = Path(__file__).parents[1]
# A loaded machine may take tens of seconds to start a process and import torch.
START_LIMIT = 120.0


@pytest.mark.parametrize(
    ("backend", "signum", "returncode"),
    [
        ("asyncio", signal.SIGTERM, 128 + signal.SIGTERM),
        ("trio", signal.SIGTERM, 128 + signal.SIGTERM),
        ("trio", signal.SIGINT, -signal.SIGINT),
    ],
)
def test_a_signal_closes_without_flush_and_releases_the_lease(
    backend: str, signum: int, returncode: int, tmp_path: Path
) -> None:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(str(p) for p in (TESTS / "node", TESTS, TESTS.parent))
    }
    with subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), backend],
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
            line = process.stdout.readline()
            assert line == "training\n", f"worker did not train: {process.communicate()}"
            assert "worker" in leases(tmp_path)
            process.send_signal(signum)
            _, stderr = process.communicate(timeout=START_LIMIT)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == returncode, stderr
    if signum == signal.SIGTERM:
        assert "Traceback" not in stderr, stderr
    assert leases(tmp_path) == {}, "the lease outlived the process"
    assert committed(tmp_path), "no round was committed"
