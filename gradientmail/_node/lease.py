"""The lease task: beats ``leases/{learner}/{beat}.{role}`` while the node runs, deletes it at
the end.

A learner's beats say ``learner`` until it begins closing, then ``closing``
(``LeaseBeats.renew``, written before its flush goes out): a syncer commits a round only on
a lease listing taken after it listed the round's snapshots, so it knows the flush for what
it is (``protocol.expectation``). The first beat continues after the newest beat already
in the store (``first_beat``; a node restarted with the same id never reuses a beat number
present, so observers see its lease renewed, not stale). Beat numbers wrap around below
``10**12``: a beat planted at the top of the range cannot make a restart fail. Each new
beat deletes the one before it. When the task is cancelled (the node is closing), it
deletes every beat of its own in a shielded scope bounded by ``RELEASE_TIMEOUT`` seconds and
reports ``LeaseReleased`` or ``ReleaseFailed``; others then see the lease gone at once.

A transient store failure while beating is retried with backoff; a beat that cannot be
written for ``lease_timeout`` lets observers judge this node gone, which is the truth.
"""

from collections.abc import Callable, Sequence
from typing import TypeAlias

import anyio
from anyio.abc import TaskStatus

from gradientmail.clock import Clock
from gradientmail.errors import MailboxUnavailable, RecordError
from gradientmail.events.kinds import Event, LeaseReleased, ReleaseFailed
from gradientmail.protocol import keys
from gradientmail.store import Store

__all__ = ["RELEASE_TIMEOUT", "LeaseBeats", "first_beat", "run_lease"]

RELEASE_TIMEOUT = 10.0
"""The longest a node spends deleting its lease at close."""

Emit: TypeAlias = Callable[[Event], None]

_BEATS = 10**12
"""Beat numbers are 12 digits (``protocol.keys.lease``)."""


def first_beat(existing: Sequence[int]) -> int:
    """The first beat of a node whose lease holds the beats ``existing``: one past the
    newest, wrapping around to the smallest number not present when that would not fit."""
    if not existing:
        return 0
    following = max(existing) + 1
    if following < _BEATS:
        return following
    taken = set(existing)
    return next(beat for beat in range(len(taken) + 1) if beat not in taken)


class LeaseBeats:
    """A node's lease: the beats the lease task writes, and the one its close writes to say
    it began closing (``renew("closing")``). One beat at a time, in order; each new beat
    deletes the one before. Used on the node's event-loop thread."""

    def __init__(self, store: Store, learner: str, role: keys.Role) -> None:
        self.store = store
        self.learner = learner
        self.role: keys.Role = role
        self._beat: int | None = None
        self._lock = anyio.Lock()

    async def begin(self) -> None:
        """The first beat, after the newest already in the store (``first_beat``); the
        beats found there are deleted."""
        async with self._lock:
            existing = await self.store.own_beats(self.learner)
            beat = first_beat([number for number, _ in existing])
            await self.store.beat(self.learner, beat, self.role)
            self._beat = beat
            await self.store.delete(key for _, key in existing)

    async def renew(self, role: keys.Role | None = None) -> None:
        """The next beat, saying ``role`` from now on when given; raises what the store
        raises (the beat before stays, and the lease with it)."""
        async with self._lock:
            if self._beat is None:
                raise RuntimeError("renew() before begin()")
            previous = keys.lease(self.learner, self._beat, self.role)
            beat, now = (self._beat + 1) % _BEATS, role or self.role
            await self.store.beat(self.learner, beat, now)
            self._beat, self.role = beat, now
            await self.store.delete([previous])


async def run_lease(
    beats: LeaseBeats,
    every: float,
    clock: Clock,
    emit_released: Emit,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Beat until cancelled, then release (see the module docstring). Reports started once
    the first beat is in the store."""
    try:
        await beats.begin()
        task_status.started()
        while True:
            await clock.sleep(every)
            await beats.renew()
    finally:
        await release(beats.store, beats.learner, emit_released)


async def release(store: Store, learner: str, emit: Emit) -> None:
    """Delete every beat of ``learner`` (shielded, bounded); report how it went: a
    transient failure or an unreadable beat is ``ReleaseFailed`` (the lease then expires on
    its own); a ``StoreAccessError`` propagates (the node fails, or its failure stands)."""
    with anyio.move_on_after(RELEASE_TIMEOUT, shield=True) as scope:
        try:
            beats = await store.own_beats(learner, attempts=3)
            await store.delete((key for _, key in beats), attempts=3)
        except (MailboxUnavailable, RecordError) as exc:
            emit(ReleaseFailed(learner, exc))
            return
    if scope.cancelled_caught:
        emit(ReleaseFailed(learner, TimeoutError(f"no reply within {RELEASE_TIMEOUT} s")))
    else:
        emit(LeaseReleased(learner))
