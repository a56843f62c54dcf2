"""A store that refuses the node mid-run (a directory it can no longer read or write, a
bucket deleted under it) fails the node at once with ``NodeFailed`` naming the access error,
rather than being retried forever. The lease beats rarely here, so that only the loops that
list, read and publish meet the refusal: a loop that retried it would leave the node running
past the deadline."""

import os
import stat
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from botocore.exceptions import ClientError
from node_helpers import CONFIG, FAST, LEARNER_ONLY, Recorder, tiny_model, train

from gradientmail._node import node as open_node
from gradientmail.errors import NodeFailed, StoreAccessError
from gradientmail.events import (
    PollFailed,
    PublishFailed,
    RecoveryFailed,
    RoundFailed,
    SyncerStopped,
)
from gradientmail.mailbox import LocalAccessError, S3AccessError

pytestmark = pytest.mark.anyio

PROMPT = 20.0
"""The deadline for the node to fail once refused: a few polls, with room for a loaded box."""

RARE_BEATS = {"lease_every": 60.0, "lease_timeout": 240.0}
"""No beat falls within ``PROMPT`` after the first: the lease task never meets the refusal."""


def _retried_refusals(sink: Recorder) -> list[object]:
    """The refusals some loop reported as if they were worth retrying."""
    reported = [*sink.of(PollFailed), *sink.of(PublishFailed)]
    reported += [*sink.of(RecoveryFailed), *sink.of(RoundFailed)]
    return [e for e in reported if isinstance(getattr(e, "error", None), StoreAccessError)]


def _chmod_tree(root: Path, mode: int) -> None:
    """``mode`` on ``root`` and every directory under it, in an order the walk survives:
    parents first when ``mode`` lets the walk in, children first when it does not."""
    entering = bool(mode & stat.S_IRUSR and mode & stat.S_IXUSR)
    if entering:
        root.chmod(mode)
    for directory, children, _ in os.walk(root, topdown=entering):
        if entering:
            for child in children:
                (Path(directory) / child).chmod(mode)
        else:
            Path(directory).chmod(mode)


def _modes_bind_us() -> bool:
    """Whether a directory's mode stops this process (not for root, whose
    ``CAP_DAC_OVERRIDE`` reads and writes whatever the mode says, unless it was dropped)."""
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch) / "probe"
        probe.mkdir(mode=0)
        try:
            os.listdir(probe)
        except PermissionError:
            return True
        finally:
            probe.chmod(0o700)
        return False


@pytest.mark.skipif(
    not _modes_bind_us(),
    reason=f"uid {os.geteuid()} reads and writes a directory whatever its mode says (root)",
)
@pytest.mark.parametrize(
    ("role", "mode"),
    [("receive", 0o000), ("syncer", 0o000), ("publisher", 0o555)],
    ids=["receive-unreadable", "syncer-unreadable", "publisher-unwritable"],
)
async def test_a_directory_that_refuses_the_node_fails_it_at_once(
    tmp_path: Path, role: str, mode: int
) -> None:
    root = tmp_path / "run"
    model = tiny_model()
    learner = replace(LEARNER_ONLY, **RARE_BEATS)
    async with open_node(model, str(root), learner="creator", config=CONFIG, options=learner):
        pass
    sink = Recorder()
    syncing = role == "syncer"

    async def run() -> None:
        async with open_node(
            None if syncing else model,
            str(root),
            learner=role,
            options=replace(FAST, **RARE_BEATS) if syncing else learner,
            sinks=[sink],
        ) as node:
            _chmod_tree(root, mode)
            while True:
                if role == "publisher":
                    await node.step(16)
                await anyio.sleep(0.01)

    try:
        with anyio.fail_after(PROMPT), pytest.raises(NodeFailed) as failed:
            await run()
    finally:
        _chmod_tree(root, 0o755)
    assert isinstance(failed.value.__cause__, LocalAccessError)
    assert "LocalAccessError" in str(failed.value)
    assert not _retried_refusals(sink)
    if syncing:
        assert [type(e.error) for e in sink.of(SyncerStopped)] == [LocalAccessError]


def _delete_bucket(client: Any, bucket: str) -> None:
    """Empty and delete ``bucket`` while a node may still write to it: again until the
    bucket is gone, for at most ``PROMPT`` seconds."""
    deadline = time.monotonic() + PROMPT
    while True:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objects = [{"Key": item["Key"]} for item in page.get("Contents", ())]
            if objects:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        try:
            client.delete_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "BucketNotEmpty" or time.monotonic() > deadline:
                raise


@pytest.fixture
def admin(_moto_admin: Any) -> Any:
    return _moto_admin


async def test_a_bucket_deleted_mid_run_fails_the_node_at_once(
    moto_server: str, admin: Any
) -> None:
    bucket = f"doomed-{uuid.uuid4().hex[:12]}"
    admin.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/run?endpoint_url={moto_server}&region=us-east-1"
    options = replace(FAST, poll_interval=0.1, **RARE_BEATS)
    model = tiny_model()
    sink = Recorder()

    async def run() -> None:
        async with open_node(
            model, url, learner="solo", config=CONFIG, options=options, sinks=[sink]
        ) as node:
            await train(node, model, seed=1, until_round=1)
            await anyio.to_thread.run_sync(_delete_bucket, admin, bucket)
            with anyio.fail_after(PROMPT):
                await anyio.sleep_forever()

    with pytest.raises(NodeFailed) as failed:
        await run()
    assert isinstance(failed.value.__cause__, S3AccessError)
    assert "S3AccessError" in str(failed.value)
    assert bucket in str(failed.value)
    assert "NoSuchBucket" in str(failed.value)
    assert not _retried_refusals(sink)
