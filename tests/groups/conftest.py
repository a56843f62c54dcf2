"""The ``ranks`` fixture: the worker processes of one test, killed at its end if still
running. ``tests/node`` is put on the path for ``node_helpers``."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

from group_helpers import Ranks


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    launched = Ranks(tmp_path)
    try:
        yield launched
    finally:
        launched.kill_all()
