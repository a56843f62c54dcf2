"""Each name in gradientmail/ says one thing: no two modules share a file name (``__init__``
aside), and no two top-level classes or public functions share a name, except the pairs in
``SHARED``, each kept with its reason (public names that users import from two places).
Methods, private helpers and names inside functions are not checked."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gradientmail"

SHARED = {
    "Barrier": "public twice: gradientmail.Barrier (async) and gradientmail.sync.Barrier "
    "(its blocking twin); one pattern in each API",
    "Node": "public twice: gradientmail.Node (async) and gradientmail.sync.Node (its "
    "blocking twin)",
    "node": "public twice: gradientmail.node (async) and gradientmail.sync.node (blocking)",
    "load": "public twice: gradientmail.load (async) and gradientmail.sync.load (blocking)",
    "open": "public twice: gradientmail.mailbox.open (a mailbox from a URL) and "
    "gradientmail.sync.open (a blocking node outside a with block)",
    "GradientmailCallback": "public twice: users import it by module path, "
    "gradientmail.integrations.transformers and .lightning (README.md, docs/integrations.md)",
    "main": "the entry point of each runnable module: the console script (cli/_app.py) and "
    "the demo's learner process (demo/worker.py)",
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def top_level_names(path: Path) -> list[str]:
    """The classes and public functions ``path`` defines at its top level."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        node.name
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
        or (isinstance(node, functions) and not node.name.startswith("_"))
    ]


def defined_twice() -> dict[str, list[str]]:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in modules():
        for name in top_level_names(path):
            where[name].append(str(path.relative_to(PACKAGE)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_two_modules_share_a_file_name() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in modules():
        if path.name != "__init__.py":
            where[path.name].append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_no_two_classes_or_public_functions_share_a_name() -> None:
    twice = defined_twice()
    assert {name: paths for name, paths in twice.items() if name not in SHARED} == {}


def test_every_shared_name_is_still_shared() -> None:
    """An allowance no longer needed goes, so that the list says only what holds."""
    assert sorted(set(SHARED) - set(defined_twice())) == []


def test_the_check_sees_classes_and_public_functions_only(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "class A:\n    def b(self) -> None: ...\n"
        "def c() -> None: ...\nasync def d() -> None: ...\ndef _e() -> None: ...\n"
    )
    assert top_level_names(module) == ["A", "c", "d"]
