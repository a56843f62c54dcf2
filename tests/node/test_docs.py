"""Every complete example in docs/node.md, and docs/examples/train_two_nodes.py, runs.

They run one after the other in a single fresh interpreter (importing torch costs seconds
per process), each as ``__main__`` with its own ``sys.argv``.
"""

import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs"
EXAMPLES = [
    block
    for block in re.findall(r"```python\n(.*?)```", (DOCS / "node.md").read_text(), flags=re.DOTALL)
    if "anyio.run(" in block
]
RUNNER = """
import runpy, sys
for arguments in [line.split("\\t") for line in sys.stdin.read().splitlines()]:
    sys.argv = arguments
    print("=== " + arguments[0], flush=True)
    runpy.run_path(arguments[0], run_name="__main__")
"""


def test_the_doc_has_a_trio_and_an_asyncio_example() -> None:
    assert any('backend="trio"' in block for block in EXAMPLES)
    assert any('backend="asyncio"' in block for block in EXAMPLES)


def test_the_examples_run(tmp_path: Path) -> None:
    commands = []
    for index, block in enumerate(EXAMPLES):
        script = tmp_path / f"node_md_{index}.py"
        script.write_text(block)
        commands.append([str(script)])
    trainer = DOCS / "examples" / "train_two_nodes.py"
    commands.append([str(trainer), str(tmp_path / "run"), "150"])
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input="\n".join("\t".join(command) for command in commands),
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    sections = result.stdout.split("=== ")[1:]
    assert len(sections) == len(commands)
    assert all(len(section.strip().splitlines()) > 1 for section in sections), result.stdout
    assert len([line for line in sections[-1].splitlines() if ": done:" in line]) == 2
