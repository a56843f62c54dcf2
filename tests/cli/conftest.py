"""Fixtures of the command-line tests (helpers in ``cli_helpers``)."""

import subprocess

import anyio
import pytest
from cli_helpers import InProcess, WrittenRun, write_run

from gradientmail.cli import main


@pytest.fixture(scope="session")
def written_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenRun:
    directory = tmp_path_factory.mktemp("written") / "run"
    return anyio.run(write_run, directory)


@pytest.fixture
def in_process(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> InProcess:
    """``cli``'s twin for tests a subprocess adds nothing to: ``gradientmail ARGS`` through
    ``cli.main`` in this process (``$COLUMNS`` 200, and ``env_extra`` set while it runs),
    its output taken from ``capsys``; a usage error's ``SystemExit`` comes back as its
    status."""
    monkeypatch.setenv("COLUMNS", "200")

    def run(
        *args: str, env_extra: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        with monkeypatch.context() as patch:
            for name, value in (env_extra or {}).items():
                patch.setenv(name, value)
            try:
                code = main(list(args))
            except SystemExit as exit:
                code = int(exit.code or 0)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["gradientmail", *args], code, out.out, out.err)

    return run
