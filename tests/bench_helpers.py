"""Running a benchmark script the way its quick tests do."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str, timeout: float = 300) -> None:
    """Run ``benchmarks/{script}`` with ``args`` from the repository's root; its output's
    end on failure."""
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-6000:]
