"""The event unions make ``match`` exhaustive: mypy flags a kind a ``match`` forgot."""

import tempfile
import textwrap
from pathlib import Path

import mypy.api

from gradientmail.events import KINDS, SyncerEvent

HANDLED = """
from typing import assert_never

from gradientmail.events.kinds import {imports}


def describe(event: SyncerEvent) -> str:
    match event:
{cases}
        case _:
            assert_never(event)
"""


def _module(kinds: list[str]) -> str:
    cases = "\n".join(f"        case {kind}():\n            return {kind!r}" for kind in kinds)
    return textwrap.dedent(HANDLED).format(imports=", ".join(["SyncerEvent", *kinds]), cases=cases)


def test_mypy_flags_a_match_that_misses_a_kind(tmp_path: Path) -> None:
    syncer_kinds = [kind.__name__ for kind in KINDS if kind in SyncerEvent.__args__]
    assert len(syncer_kinds) == 11
    (tmp_path / "complete.py").write_text(_module(syncer_kinds))
    (tmp_path / "missing.py").write_text(
        _module([kind for kind in syncer_kinds if kind != "RoundSuperseded"])
    )
    stdout, stderr, status = mypy.api.run(
        [
            "--strict",
            # A cache of its own outside the run's tmp_path: warm, the check takes a second
            # instead of ten; mypy replaces cache files atomically and rechecks stale ones.
            f"--cache-dir={Path(tempfile.gettempdir()) / 'gradientmail-test-mypy-cache'}",
            str(tmp_path / "complete.py"),
            str(tmp_path / "missing.py"),
        ]
    )
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 1, stdout + stderr
    assert len(errors) == 1, stdout
    assert "missing.py" in errors[0]
    assert '"assert_never" has incompatible type "RoundSuperseded"' in errors[0]
