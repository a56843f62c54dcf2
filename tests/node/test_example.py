"""The example trainer in docs/examples runs as documented."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "docs" / "examples" / "train_two_nodes.py"


def test_the_two_node_example_trains_and_closes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path / "run"), "150"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    done = [line for line in result.stdout.splitlines() if ": done:" in line]
    assert len(done) == 2, result.stdout
    assert (tmp_path / "run").is_dir()
