"""Throttling and 5xx bursts longer than botocore's retries, against a real moto server
behind a relay on 127.0.0.1 that injects the faults for a number of requests and forwards
every other request unchanged: each operation raises ``MailboxUnavailable`` (the store's
error chained), ``retrying`` outlasts the burst, and a node rides through it and commits."""

from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch
from _mailbox_fake_s3 import Burst, Request, fake_s3, faulty_relay, response, s3_error
from botocore.exceptions import ClientError
from run_checks import Recorder, commits_by_round
from torch import nn

from gradientmail._node import NodeOptions
from gradientmail._node import node as open_node
from gradientmail.mailbox import MailboxUnavailable, S3Mailbox, retrying
from gradientmail.mailbox.s3 import S3AccessError
from gradientmail.protocol.records import RunConfig

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("aws_credentials")]

SLOW_DOWN = s3_error(503, "Slow Down", "SlowDown")
INTERNAL = s3_error(500, "Internal Server Error", "InternalError")
UNAVAILABLE = s3_error(503, "Service Unavailable", "ServiceUnavailable")
TOO_MANY = s3_error(429, "Too Many Requests", "TooManyRequests")
# Longer than botocore's standard retries (three attempts) for any one operation.
BURST = 7


def quick(endpoint: str, bucket: str) -> S3Mailbox:
    return S3Mailbox(bucket, "run", endpoint_url=endpoint, connect_timeout=2, read_timeout=5)


def operations(mailbox: S3Mailbox) -> dict[str, Callable[[], Awaitable[object]]]:
    return {
        "put": lambda: mailbox.put_if_absent("new", b"fresh"),
        "get": lambda: mailbox.get("old"),
        "list": lambda: mailbox.list(""),
        "delete": lambda: mailbox.delete(["gone"]),
    }


async def test_every_operation_reports_a_burst_as_unavailable(
    moto_server: str, s3_bucket: str
) -> None:
    burst = Burst([SLOW_DOWN])
    failed: dict[str, MailboxUnavailable] = {}

    async def attempt(name: str, operation: Callable[[], Awaitable[object]]) -> None:
        with pytest.raises(MailboxUnavailable) as caught:
            await operation()
        failed[name] = caught.value

    async with (
        faulty_relay(moto_server, burst) as (endpoint, log),
        quick(endpoint, s3_bucket) as box,
    ):
        named = operations(box)
        # Exactly botocore's three attempts of each, each answered SlowDown; all at once, so
        # that their backoffs overlap.
        burst.start(3 * len(named))
        before = len(log.requests)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for name, operation in named.items():
                    group.start_soon(attempt, name, operation)
        attempts = Counter(_operation_of(r) for r in log.requests[before:])
        assert attempts == dict.fromkeys(named, 3)
        assert burst.remaining == 0
        for name, error in failed.items():
            assert isinstance(error.__cause__, ClientError), name
            assert error.__cause__.response["Error"]["Code"] == "SlowDown"
            assert "SlowDown" in str(error)
        assert await box.put_if_absent("new", b"fresh")
        assert await box.get("new") == b"fresh"


def _operation_of(request: Request) -> str:
    """Which of ``operations`` sent ``request``."""
    if request.method == "POST":
        return "delete"
    if request.method == "PUT":
        return "put"
    return "list" if "list-type" in request.target else "get"


@pytest.mark.parametrize(
    ("fault", "code", "attempts"),
    [
        (INTERNAL, "InternalError", 3),
        (UNAVAILABLE, "ServiceUnavailable", 3),
        # botocore does not retry a 429 with R2's code: one attempt.
        (TOO_MANY, "TooManyRequests", 1),
    ],
)
async def test_5xx_and_429_outlasting_the_retries_are_unavailable(
    moto_server: str, s3_bucket: str, fault: bytes, code: str, attempts: int
) -> None:
    burst = Burst([fault])
    async with faulty_relay(moto_server, burst) as (endpoint, _), quick(endpoint, s3_bucket) as box:
        burst.start(attempts + 1)
        with anyio.fail_after(30), pytest.raises(MailboxUnavailable) as caught:
            await box.get("k")
        assert caught.value.__cause__.response["Error"]["Code"] == code
        assert burst.remaining == 1
        # The next request reaches the store.
        burst.start(0)
        assert await box.get("k") is None


async def test_retrying_outlasts_a_burst_longer_than_the_sdk_retries(
    moto_server: str, s3_bucket: str
) -> None:
    burst = Burst([SLOW_DOWN, INTERNAL, TOO_MANY, UNAVAILABLE])
    async with faulty_relay(moto_server, burst) as (endpoint, _), quick(endpoint, s3_bucket) as box:
        burst.start(BURST)
        with anyio.fail_after(30):
            assert await retrying(lambda: box.put_if_absent("k", b"v"), max_delay=0.05)
        assert burst.injected == BURST
        assert await box.get("k") == b"v"


async def test_a_throttled_key_in_a_bulk_delete_is_unavailable() -> None:
    async def throttled(request: Request) -> bytes:
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>'
            b"<Error><Key>run/b</Key><Code>SlowDown</Code><Message>later</Message></Error>"
            b"</DeleteResult>"
        )
        return response(200, "OK", body)

    async with fake_s3(throttled) as (endpoint, _), quick(endpoint, "bucket") as box:
        with anyio.fail_after(30), pytest.raises(MailboxUnavailable, match="SlowDown"):
            await box.delete(["a", "b"])


async def test_a_store_lacking_a_needed_request_is_named_not_retried() -> None:
    async def unimplemented(request: Request) -> bytes:
        return s3_error(501, "Not Implemented", "NotImplemented")

    async with fake_s3(unimplemented) as (endpoint, log), quick(endpoint, "bucket") as box:
        with anyio.fail_after(30), pytest.raises(S3AccessError, match="does not implement"):
            await box.put_if_absent("k", b"x")
    assert len(log.requests) == 1


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.x = torch.randn(64, 4)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(self.x), self.y).backward()
        with torch.no_grad():
            for param in self.model.parameters():
                if param.grad is not None:
                    param.sub_(param.grad, alpha=0.05)


async def test_a_node_rides_through_a_burst_of_throttling_and_5xx(
    moto_server: str, s3_bucket: str
) -> None:
    # Every request of the node fails while the burst lasts: far more than botocore's
    # three attempts of any one of them.
    burst = Burst([SLOW_DOWN, INTERNAL, TOO_MANY, UNAVAILABLE])
    sink = Recorder()
    options = NodeOptions(
        poll_interval=0.05,
        lease_every=0.5,
        lease_timeout=5.0,
        claim_timeout=2.0,
        creation_timeout=1.0,
        close_timeout=10.0,
        max_retry_delay=0.1,
    )
    config = RunConfig(fragments=1, sync_every=2, grace=0.1)
    trainer = Trainer()

    def committed() -> set[int]:
        return set(commits_by_round(sink.events))

    async def train_until(done: Callable[[], bool]) -> None:
        while not done():
            await anyio.to_thread.run_sync(trainer.step)
            await node.step(tokens=16)
            await anyio.sleep(0.005)

    async with faulty_relay(moto_server, burst) as (endpoint, _):
        url = f"s3://{s3_bucket}/run?endpoint_url={endpoint}&region=us-east-1"
        with anyio.fail_after(120):
            async with open_node(
                trainer.model, url, learner="solo", config=config, options=options, sinks=[sink]
            ) as node:
                await train_until(lambda: len(committed()) >= 2)
                before = max(committed())
                burst.start(30)
                await train_until(lambda: burst.remaining == 0)
                await train_until(lambda: max(committed()) >= before + 2)
    assert burst.injected == 30
    rounds = sorted(committed())
    assert rounds == list(range(rounds[0], rounds[-1] + 1))
    assert all(count == 1 for count in commits_by_round(sink.events).values())
