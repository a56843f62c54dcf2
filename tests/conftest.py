"""Every async test runs under asyncio and trio (anyio's pytest plugin)."""

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
