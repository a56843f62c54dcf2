"""Blocking calls on a run's store for synchronous code: ``load`` and ``Barrier``, re-exported
by ``gradientmail.sync``. Each call runs its own event loop in the calling thread
(``anyio.run``) and leaves nothing running when it returns; call them from code that is not
already inside an event loop."""

from typing import Literal

import anyio
from torch import nn

from gradientmail.clock import Clock
from gradientmail.patterns import barrier
from gradientmail.protocol.keys import check_learner
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import Source, open_mailbox
from gradientmail.reader import load as load_async

__all__ = ["Barrier", "load"]

Backend = Literal["asyncio", "trio"]


def load(
    source: str,
    model: nn.Module,
    *,
    run_key: RunKey | str | None = None,
    backend: Backend = "asyncio",
) -> list[Source]:
    """``gradientmail.load`` from synchronous code: put the newest committed weights of the
    run at ``source`` (a URL or a directory) into ``model`` in place and return where each
    fragment came from. Raises what ``gradientmail.load`` raises (``NoRun``,
    ``RunMismatch``, ``MailboxUnavailable``)."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a URL or a directory (a str), got {source!r}")
    return anyio.run(lambda: load_async(source, model, run_key=run_key), backend=backend)


class Barrier:
    """``gradientmail.Barrier`` from synchronous code, on the store at ``url``:
    ``Barrier(url, learner).wait(f"epoch-{n}", parties=2)`` blocks the calling thread until
    ``parties`` learners have arrived at that name. Arguments, results and errors are
    ``gradientmail.Barrier``'s (``TimeoutError`` after ``timeout`` seconds, ``ValueError``
    for a bad name, learner or interval; the learner is checked here, before any I/O)."""

    def __init__(
        self,
        url: str,
        learner: str,
        *,
        poll_interval: float = 1.0,
        clock: Clock | None = None,
        backend: Backend = "asyncio",
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a URL or a directory (a str), got {url!r}")
        self._url = url
        self._learner = check_learner(learner)
        self._poll_interval = barrier._check_seconds("poll_interval", poll_interval, zero_ok=False)
        self._clock = clock
        self._backend = backend

    @property
    def learner(self) -> str:
        return self._learner

    def wait(self, name: str, *, parties: int, timeout: float | None = None) -> frozenset[str]:
        """``gradientmail.Barrier.wait`` in a fresh event loop on the calling thread."""

        async def wait() -> frozenset[str]:
            async with open_mailbox(self._url, must_exist=False) as box:
                waiting = barrier.Barrier(
                    box, self._learner, poll_interval=self._poll_interval, clock=self._clock
                )
                return await waiting.wait(name, parties=parties, timeout=timeout)

        return anyio.run(wait, backend=self._backend)

    def __repr__(self) -> str:
        return f"sync.Barrier({self._url!r}, {self._learner!r})"
