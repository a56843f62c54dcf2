"""The basics (layer 0 of ``docs/architecture.md``) import nothing else of gradientmail, so
every layer above may import them."""

import ast
from pathlib import Path

import gradientmail

PACKAGE = Path(gradientmail.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"


def _basics() -> list[str]:
    """The modules the doc's layer-0 row names: its backticked names outside parentheses."""
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| 0. basics |"))
    cell = row.split("|")[2]
    names, depth, name = [], 0, None
    for char in cell:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "`" and depth == 0:
            if name is None:
                name = ""
            else:
                names.append(name)
                name = None
        elif name is not None:
            name += char
    return names


def _imported(path: Path) -> set[str]:
    """The gradientmail modules ``path`` imports, by their first name below the package,
    wherever the import stands (``TYPE_CHECKING`` blocks and functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            if parts[0] == "gradientmail":
                found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gradientmail" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_the_basics_import_only_the_basics() -> None:
    basics = _basics()
    assert {"errors", "clock"} <= set(basics)
    beyond = {
        name: sorted(_imported(PACKAGE / f"{name}.py") - set(basics))
        for name in basics
        if _imported(PACKAGE / f"{name}.py") - set(basics)
    }
    assert beyond == {}
