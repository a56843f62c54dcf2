"""The layers of ``docs/architecture.md`` hold: the basics (layer 0) import nothing else of
gradientmail, and every module imports only from its own layer and the layers below."""

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


def _layers() -> dict[str, int]:
    """Every top-level module or package of gradientmail by the layer of the doc's table
    whose row names it (backticked, ``protocol/keys`` naming ``protocol``), at any depth."""
    tops = {path.stem for path in PACKAGE.glob("*.py")} | {
        path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()
    }
    layers = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| ") and line[2].isdigit() and ". " in line[:6]:
            number = int(line[2])
            for name in line.split("|")[2].split("`")[1::2]:
                top = name.split("/")[0]
                if top in tops:
                    layers.setdefault(top, number)
    return layers


def test_every_import_runs_down_the_layers() -> None:
    layers = _layers()
    modules = [
        path
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in ("__init__.py", "__main__.py")
    ]
    unplaced = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in modules}
    assert unplaced - set(layers) == set()
    upward = {}
    for path in modules:
        own = layers[path.relative_to(PACKAGE).parts[0].removesuffix(".py")]
        above = {name for name in _imported(path) if layers.get(name, -1) > own}
        if above:
            upward[str(path.relative_to(PACKAGE))] = sorted(above)
    assert upward == {}
