"""The command line's read and identity commands start without importing torch: each runs
in a fresh interpreter through ``gradientmail.cli.main``, which then reports whether torch
was imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import WrittenRun

_RUN_THEN_REPORT = """
import sys
from gradientmail.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print(f"exit {code}, torch imported: {'torch' in sys.modules}", file=sys.stderr)
"""

_PUBLIC_KEY = "ab" * 32


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["status", "--help"], 0),
        (["status", "{run}", "--json"], 0),
        (["status", "{run}"], 0),
        (["keygen", "{tmp}/key.pem"], 0),
        (["admit", "{run}", "b", _PUBLIC_KEY], 1),
        (["revoke", "{run}", _PUBLIC_KEY], 1),
        (["report", "{run}", "--out", "{tmp}/report.html"], 0),
    ],
    ids=["help", "status-help", "status-json", "status", "keygen", "admit", "revoke", "report"],
)
def test_read_and_identity_commands_do_not_import_torch(
    written_run: WrittenRun, tmp_path: Path, argv: list[str], code: int
) -> None:
    """``admit`` and ``revoke`` without the run key fail (1) after their imports."""
    args = [arg.format(run=written_run.directory, tmp=tmp_path) for arg in argv]
    result = subprocess.run(
        [sys.executable, "-c", _RUN_THEN_REPORT, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", "GRADIENTMAIL_RUN_KEY": ""},
        cwd=tmp_path,
        check=False,
    )
    assert result.stderr.splitlines()[-1] == f"exit {code}, torch imported: False", result.stderr
