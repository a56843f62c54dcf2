"""docs/examples/torchrun_ddp.py and torchrun_fsdp.py run under torchrun: two ranks, one
learner, rounds committed, and both ranks end on the same state."""

import re
from pathlib import Path

import anyio
import pytest
from group_helpers import torchrun
from node_helpers import records

from gradientmail.mailbox import LocalMailbox

EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"


@pytest.mark.parametrize("example", ["torchrun_ddp.py", "torchrun_fsdp.py"])
def test_the_torchrun_example_runs(tmp_path: Path, example: str) -> None:
    run = tmp_path / "run"
    result = torchrun(EXAMPLES / example, str(run), "site-1", "72")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    done = sorted(re.findall(r"site-1 rank (\d)/2: done: (.*) store", result.stdout))
    assert [rank for rank, _ in done] == ["0", "1"], result.stdout
    assert done[0][1] == done[1][1], "the ranks disagree on steps or round"
    assert done[0][1].startswith("72 steps")
    history = anyio.run(records, LocalMailbox(run))
    assert len(history) >= 72 // 24 * 3
    assert {p.learner for r in history for p in r.participants} == {"site-1"}
