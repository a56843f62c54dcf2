"""Calls run at once in a task group of their own, failing as a sequential caller would see
it: the one helper the store's callers, the reader and the S3 mailbox's parts share. Runs in
the caller's task; the calls are its children, so none outlives it.
"""

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

__all__ = ["gather"]

T = TypeVar("T")


async def gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``calls`` concurrently (one task each) and return their results in order.

    When some fail, the first failure (in completion order) is raised on its own, as a
    sequential caller would see it, unless a cancellation is among them; the other calls
    are cancelled.
    """
    results: dict[int, T] = {}

    async def one(index: int, call: Callable[[], Awaitable[T]]) -> None:
        results[index] = await call()

    try:
        async with anyio.create_task_group() as tg:
            for index, call in enumerate(calls):
                tg.start_soon(one, index, call)
    except BaseExceptionGroup as group:
        errors = group.exceptions
        if all(isinstance(error, Exception) for error in errors):
            raise errors[0] from None
        raise
    return [results[index] for index in range(len(calls))]
