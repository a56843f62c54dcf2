"""The contract suite's fixtures: one ``mailbox`` per backend (memory, local, s3 on moto,
and ceph: S3 on Ceph's RADOS Gateway, marked ``ceph`` and run by ``nox -s ceph`` only),
entered."""

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox, S3Mailbox

BACKENDS = ("memory", "local", "s3", pytest.param("ceph", marks=pytest.mark.ceph))
# Each S3 backend's server and fresh-bucket fixtures.
S3_SERVERS = {"s3": ("moto_server", "s3_bucket"), "ceph": ("ceph_server", "ceph_bucket")}
# A prefix, so that every test also checks that it scopes keys and is stripped.
S3_PREFIX = "run/"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def s3_endpoint(backend: str, request: pytest.FixtureRequest) -> str:
    """The endpoint URL of an S3 backend's server."""
    return str(request.getfixturevalue(S3_SERVERS[backend][0]))


@pytest.fixture
def make_mailbox(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], Mailbox]:
    """Builds (without entering) a fresh, empty mailbox of the parametrized backend."""
    if backend == "memory":
        return MemoryMailbox
    if backend == "local":
        return lambda: LocalMailbox(tmp_path / "mailbox")
    endpoint: str = request.getfixturevalue("s3_endpoint")
    bucket: str = request.getfixturevalue(S3_SERVERS[backend][1])
    return lambda: S3Mailbox(bucket, S3_PREFIX, endpoint_url=endpoint, max_concurrency=32)


@pytest.fixture
async def mailbox(make_mailbox: Callable[[], Mailbox]) -> AsyncIterator[Mailbox]:
    async with make_mailbox() as opened:
        yield opened
