"""The contract's shared pieces: key rules and ``retrying``."""

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from gradientmail.mailbox import (
    MAX_KEY_BYTES,
    MailboxUnavailable,
    check_key,
    check_prefix,
    retrying,
)


class RecordingClock:
    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def now(self) -> float:
        return sum(self.sleeps)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await anyio.lowlevel.checkpoint()


def failing(
    times: int, error: Exception | None = None
) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def op() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error if error is not None else MailboxUnavailable("down")
        return "done"

    return calls, op


def test_valid_keys_and_prefixes_pass_through() -> None:
    for key in ("a", "a/b", "é/日本", "x" * MAX_KEY_BYTES, ".hidden", "a..b", "a/.../b"):
        assert check_key(key) == key
    for prefix in ("", "a", "a/", "a/b/"):
        assert check_prefix(prefix) == prefix


@pytest.mark.anyio
async def test_retrying_backs_off_doubling_to_the_cap() -> None:
    clock = RecordingClock()
    calls, op = failing(7)
    assert await retrying(op, clock=clock, max_delay=4.0) == "done"
    assert len(calls) == 8
    assert clock.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


@pytest.mark.anyio
async def test_retrying_lets_other_errors_through_at_once() -> None:
    clock = RecordingClock()
    calls, op = failing(3, KeyError("not transient"))
    with pytest.raises(KeyError):
        await retrying(op, clock=clock)
    assert len(calls) == 1
    assert clock.sleeps == []


@pytest.mark.anyio
async def test_retrying_gives_up_after_the_attempts() -> None:
    clock = RecordingClock()
    calls, op = failing(10)
    with pytest.raises(MailboxUnavailable):
        await retrying(op, clock=clock, attempts=3)
    assert len(calls) == 3
    assert clock.sleeps == [0.5, 1.0]


@pytest.mark.anyio
async def test_cancelling_retrying_stops_it() -> None:
    calls, op = failing(1000)
    with anyio.move_on_after(0.2) as scope:
        await retrying(op, max_delay=0.01)
    assert scope.cancelled_caught
    count = len(calls)
    await anyio.sleep(0.05)
    assert len(calls) == count


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("options", "message"),
    [({"max_delay": 0.0}, "max_delay"), ({"attempts": 0}, "attempts must be at least 1")],
)
async def test_retrying_refuses_bad_options(options: dict[str, float], message: str) -> None:
    calls, op = failing(0)
    with pytest.raises(ValueError, match=message):
        await retrying(op, **options)  # type: ignore[arg-type]
    assert calls == []
