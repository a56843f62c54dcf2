"""Fixtures of the command-line tests (helpers in ``cli_helpers``)."""

import anyio
import pytest
from cli_helpers import WrittenRun, write_run


@pytest.fixture(scope="session")
def written_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenRun:
    directory = tmp_path_factory.mktemp("written") / "run"
    return anyio.run(write_run, directory)
