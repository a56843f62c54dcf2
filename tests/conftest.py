"""Every async test runs under asyncio and trio (anyio's pytest plugin).

S3 tests talk HTTP to a real moto server on 127.0.0.1: ``moto_server`` (one per session)
yields its endpoint URL, ``s3_bucket`` a fresh bucket on it per test, and ``moto_servers``
starts dedicated ones that a test may pause, stop and restart. Tests marked ``ceph`` (``nox
-s ceph``) talk to Ceph's RADOS Gateway instead: ``ceph_server`` starts a throwaway
single-node cluster once per session (``ceph_cluster``), ``ceph_bucket`` is a fresh bucket
on it.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ceph_cluster import CephCluster, missing_tools


def pytest_configure(config: pytest.Config) -> None:
    # aiobotocore warns, once per process, that plain httpx is deprecated as its backend in
    # favour of the fork httpx2. Both work; under ``filterwarnings = error`` the warning
    # would fail whichever S3 test happens to create the first client.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:aiobotocore's httpx backend now prefers httpx2:DeprecationWarning",
    )


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


MOTO_SERVER = Path(__file__).with_name("moto_server.py")


class MotoServer:
    """A moto server subprocess on 127.0.0.1 (state lives in its memory), its conditional
    PUTs atomic as S3's are (``moto_server.py``)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port if port is not None else _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until it accepts connections."""
        self._process = subprocess.Popen(
            [sys.executable, str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto server on port {self.port} exited at start")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server (its objects are lost) and reap it."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing is answered."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused server answers again, its objects intact."""
        self._signal(signal.SIGCONT)

    def _signal(self, number: int) -> None:
        if self._process is None:
            raise RuntimeError(f"moto server on port {self.port} is not running")
        os.kill(self._process.pid, number)


@pytest.fixture(scope="session")
def aws_credentials() -> Iterator[None]:
    # The mailbox reads the standard AWS chain; these stop it at the environment, before
    # any shared file or instance-metadata lookup.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        patch.delenv("AWS_PROFILE", raising=False)
        patch.delenv("AWS_SESSION_TOKEN", raising=False)
        patch.setenv("AWS_CONFIG_FILE", os.devnull)
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        yield


@pytest.fixture(scope="session")
def moto_server(aws_credentials: None) -> Iterator[str]:
    """The endpoint URL ``http://127.0.0.1:PORT`` of a moto server shared by the session."""
    server = MotoServer()
    server.start()
    try:
        yield server.endpoint
    finally:
        server.stop()


def _admin_client(endpoint: str) -> Any:
    """A plain synchronous botocore client on ``endpoint`` for setting up fixtures."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1"
    )


def _fresh_bucket(admin: Any) -> Iterator[str]:
    """A fresh empty bucket through ``admin``, emptied and removed afterwards (moto and the
    Ceph of ``ceph_server`` both keep objects in memory)."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    admin.create_bucket(Bucket=name)
    yield name
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=name):
        objects = [{"Key": item["Key"]} for item in page.get("Contents", ())]
        if objects:
            admin.delete_objects(Bucket=name, Delete={"Objects": objects, "Quiet": True})
    admin.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def _moto_admin(moto_server: str) -> Iterator[Any]:
    client = _admin_client(moto_server)
    yield client
    client.close()


@pytest.fixture
def s3_bucket(_moto_admin: Any) -> Iterator[str]:
    """A fresh empty bucket on ``moto_server`` for one test, removed afterwards."""
    yield from _fresh_bucket(_moto_admin)


@pytest.fixture(scope="session")
def ceph_server(aws_credentials: None) -> Iterator[str]:
    """The endpoint URL ``http://127.0.0.1:PORT`` of the RADOS Gateway of a single-node
    Ceph cluster shared by the session, whose S3 user has the keys of ``aws_credentials``;
    every daemon is killed and its directory removed at the end of the session. Fails
    (never skips) when Ceph is not installed: ``.ci/ceph`` installs it."""
    if missing := missing_tools():
        pytest.fail(f"Ceph is not installed ({', '.join(missing)} missing): run .ci/ceph")
    cluster = CephCluster(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    try:
        cluster.start()
        yield cluster.endpoint
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def _ceph_admin(ceph_server: str) -> Iterator[Any]:
    client = _admin_client(ceph_server)
    yield client
    client.close()


@pytest.fixture
def ceph_bucket(_ceph_admin: Any) -> Iterator[str]:
    """A fresh empty bucket on ``ceph_server`` for one test, removed afterwards."""
    yield from _fresh_bucket(_ceph_admin)


@pytest.fixture
def moto_servers(aws_credentials: None) -> Iterator[Callable[[], MotoServer]]:
    """Start dedicated moto servers (``moto_servers()`` returns one, started) that the test
    may pause, stop or restart; all are stopped at the end of the test."""
    started: list[MotoServer] = []

    def start() -> MotoServer:
        server = MotoServer()
        started.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
