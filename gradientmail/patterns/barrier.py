"""A rendezvous through the store: hold nodes at a named point until enough have arrived."""

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import anyio

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.mailbox import Mailbox, check_key, retrying
from gradientmail.protocol.keys import check_learner

__all__ = ["BARRIERS", "Barrier", "arrivals"]

BARRIERS = "barriers/"
"""Where arrivals live: ``barriers/{name}/{learner}``, one create-once empty object each."""

_log = logging.getLogger("gradientmail.patterns")


def arrivals(prefix: str, keys: Sequence[str]) -> frozenset[str]:
    """The learners whose arrival key is among ``keys`` (a listing of ``prefix``).

    Keys deeper than one segment below ``prefix`` are not arrivals and are ignored.
    """
    return frozenset(
        rest
        for key in keys
        if key.startswith(prefix) and (rest := key[len(prefix) :]) and "/" not in rest
    )


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(
            f"invalid barrier name {name!r}: use one non-empty key segment without '/', "
            "e.g. f'epoch-{n}'"
        )
    try:
        check_key(f"{BARRIERS}{name}/x")
    except ValueError as exc:
        raise ValueError(f"invalid barrier name {name!r}: {exc}") from None
    return name


def _check_parties(parties: int) -> int:
    if isinstance(parties, bool) or not isinstance(parties, int) or parties < 1:
        raise ValueError(
            f"parties must be an int of at least 1 (the nodes to wait for), got {parties!r}"
        )
    return parties


def _check_seconds(what: str, value: float, *, zero_ok: bool) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero_ok)
    ):
        bound = "at least 0" if zero_ok else "greater than 0"
        raise ValueError(f"{what} must be a finite number of seconds {bound}, got {value!r}")
    return float(value)


class Barrier:
    """A rendezvous through the mailbox: ``wait(name, parties=n)`` returns once ``n`` nodes arrived.

    Nodes share a run-scoped mailbox, each with its own learner id (``protocol.keys``' rules:
    the node's own id is the natural choice). An arrival is the create-once empty object
    ``barriers/{name}/{learner}``; ``wait`` creates this node's and then lists
    ``barriers/{name}/`` every ``poll_interval`` seconds until it holds ``parties`` arrivals or
    more. Arrivals are never removed, so a name serves once per run: a loop names each of its
    barriers (``f"epoch-{n}"``), and a node that arrives after the barrier opened passes at
    once. Nothing is kept in memory between calls; one instance may serve any number of
    names and concurrent waits.

    Every store operation is retried through ``gradientmail.mailbox.retrying`` while it
    raises ``MailboxUnavailable``; any other store error propagates from ``wait``. ``clock``
    (default ``MonotonicClock``) times the polls, the retries and the timeout. Constructing a
    barrier does no I/O; it raises ``ValueError`` for an invalid learner id or poll interval.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        learner: str,
        *,
        poll_interval: float = 1.0,
        clock: Clock | None = None,
    ) -> None:
        self._mailbox = mailbox
        self._learner = check_learner(learner)
        self._poll_interval = _check_seconds("poll_interval", poll_interval, zero_ok=False)
        self._clock = clock if clock is not None else MonotonicClock()

    @property
    def learner(self) -> str:
        return self._learner

    # ``timeout`` runs on the injected clock, which a caller's ``fail_after`` cannot.
    async def wait(
        self,
        name: str,
        *,
        parties: int,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> frozenset[str]:
        """Record this node's arrival at ``name``; return once ``parties`` nodes have arrived.

        Returns the learner ids the listing that opened the barrier held: at least
        ``parties`` of them, this node's included; nodes that see the barrier open at
        different moments may see different supersets. ``parties`` is a count the caller
        fixes and every node should pass the same one; it need not match the run's quorum.

        With ``timeout``, raises ``TimeoutError`` after that many seconds on the clock
        (store retries included) without the barrier opening; the message says how many of
        ``parties`` nodes had arrived at the last listing. The arrival stays recorded (unless
        the store never answered), so calling again resumes the wait. Calling again once
        the barrier has opened returns after one listing, without sleeping.

        Raises ``ValueError`` for an invalid name (one key segment, no ``/``), ``parties``
        below 1 or a negative timeout, before any I/O. Runs in the calling task (with one
        helper task for the timeout); cancellation propagates at once, leaving the arrival
        recorded or not.
        """
        _check_name(name)
        _check_parties(parties)
        if timeout is not None:
            timeout = _check_seconds("timeout", timeout, zero_ok=True)
        seen = _Seen()
        attend = partial(self._attend, name, parties, seen)
        if timeout is None:
            return await attend()
        opened = await self._within(attend, timeout)
        if opened is not None:
            return opened
        raise _timed_out(name, parties, timeout, seen.last)

    async def _attend(self, name: str, parties: int, seen: "_Seen") -> frozenset[str]:
        """Record this node's arrival at ``name``, then list the arrivals every poll interval
        (the newest listing in ``seen``) until ``parties`` have arrived; return them."""
        prefix = f"{BARRIERS}{name}/"
        await retrying(
            partial(self._mailbox.put_if_absent, f"{prefix}{self._learner}", b""),
            clock=self._clock,
        )
        while True:
            seen.last = arrivals(
                prefix, await retrying(partial(self._mailbox.list, prefix), clock=self._clock)
            )
            if len(seen.last) >= parties:
                _log.debug(
                    "barrier %r opened for %s with %d arrivals", name, self._learner, len(seen.last)
                )
                return seen.last
            await self._clock.sleep(self._poll_interval)

    async def _within(
        self, attend: Callable[[], Awaitable[frozenset[str]]], seconds: float
    ) -> frozenset[str] | None:
        """What ``attend()`` returns, or None once ``seconds`` pass on the clock first."""
        opened: frozenset[str] | None = None
        failure: Exception | None = None

        async def alarm(scope: anyio.CancelScope) -> None:
            await self._clock.sleep(seconds)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(alarm, tg.cancel_scope)
            # Caught here and raised below so that a store error leaves ``wait`` as itself,
            # not wrapped in the task group's ExceptionGroup.
            try:
                opened = await attend()
            except Exception as exc:
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return opened

    def __repr__(self) -> str:
        return f"Barrier(learner={self._learner!r}, poll_interval={self._poll_interval})"


@dataclass(slots=True)
class _Seen:
    """The newest listing of a barrier's arrivals one ``wait`` took (None: none yet)."""

    last: frozenset[str] | None = None


def _timed_out(
    name: str, parties: int, timeout: float, seen: frozenset[str] | None
) -> TimeoutError:
    if seen is None:
        return TimeoutError(
            f"barrier {name!r}: the store did not answer within {timeout} s "
            f"(0 of {parties} nodes known to have arrived)"
        )
    return TimeoutError(
        f"barrier {name!r}: {len(seen)} of {parties} nodes arrived within {timeout} s "
        f"({_names(seen)})"
    )


def _names(learners: frozenset[str], limit: int = 8) -> str:
    ordered = sorted(learners)
    shown = ", ".join(ordered[:limit])
    more = len(ordered) - limit
    return (shown + (f" and {more} more" if more > 0 else "")) if ordered else "none yet"
