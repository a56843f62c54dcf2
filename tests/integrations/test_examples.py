"""docs/examples/char_lm.py and its port to a gradientmail learner: the port changes fewer
than 15 lines and re-indents none, docs/integrations.md shows the current diff, and both
scripts run."""

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[2] / "docs"
ORIGINAL = DOCS / "examples" / "char_lm.py"
PORT = DOCS / "examples" / "char_lm_gradientmail.py"
TINY = ["--epochs", "1", "--batches", "24", "--hidden", "16", "--batch-size", "4", "--bptt", "16"]
RUNNER = """
import runpy, sys
for arguments in [line.split("\\t") for line in sys.stdin.read().splitlines()]:
    sys.argv = arguments
    print("=== " + arguments[0], flush=True)
    runpy.run_path(arguments[0], run_name="__main__")
"""


def port_diff() -> list[str]:
    """The diff docs/integrations.md shows: unified, three lines of context."""
    return list(
        difflib.unified_diff(
            ORIGINAL.read_text().splitlines(),
            PORT.read_text().splitlines(),
            "char_lm.py",
            "char_lm_gradientmail.py",
            lineterm="",
        )
    )


def test_the_port_changes_fewer_than_15_lines() -> None:
    changed = [
        line for line in port_diff() if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert 0 < len(changed) < 15, "\n".join(changed)


def test_the_port_re_indents_no_line() -> None:
    removed = {
        line[1:].strip() for line in port_diff() if line.startswith("-") and line[1:2] != "-"
    }
    added = {line[1:].strip() for line in port_diff() if line.startswith("+") and line[1:2] != "+"}
    # The epoch loop sits at the script's top level, in a try for Ctrl-C, not in a function.
    assert "\ntry:\n    for epoch in range(1, args.epochs + 1):\n" in ORIGINAL.read_text()
    assert not removed & added, removed & added


def test_the_docs_show_the_current_diff() -> None:
    blocks = re.findall(r"```diff\n(.*?)```", (DOCS / "integrations.md").read_text(), re.DOTALL)
    assert blocks == ["\n".join(port_diff()) + "\n"]


@pytest.mark.slow
def test_the_original_and_the_port_run(tmp_path: Path) -> None:
    commands = [
        [str(ORIGINAL), *TINY, "--save", str(tmp_path / "one.pt")],
        [
            str(PORT),
            *TINY,
            "--save",
            str(tmp_path / "port.pt"),
            "--run",
            str(tmp_path / "run"),
            "--learner",
            "host-0",
            "--learners",
            "1",
        ],
    ]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input="\n".join("\t".join(command) for command in commands),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    sections = result.stdout.split("=== ")[1:]
    assert len(sections) == 2
    assert all("| end of training | valid loss" in section for section in sections)
    assert list((tmp_path / "run" / "objects" / "records").iterdir()), "no round committed"
