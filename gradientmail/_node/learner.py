"""The learner: the state of one node's local training with respect to the run, and the two
tasks that move its bytes (receive, publish).

``LearnerState`` is an immutable value, replaced on the event-loop thread by its pure
transitions; the node holds the current one. Per fragment it keeps the base ``B`` (θ of the
version its local weights started from), the snapshot in flight, and the alignment the
receive task has prepared:

- a due fragment ``f`` is snapshotted (``S``, a CPU copy) for round
  ``round_of(f, version(B) + 1)`` unless a snapshot of it is in flight or an alignment of it
  is pending; its steps keep accumulating otherwise;
- the receive task folds every new record, in round order, into the ``Ledger`` (step
  accounting) and notes the outcome of this learner's snapshot, then downloads the newest
  committed version of each fragment: ``B + decode(update)`` when it is the next version,
  the record's θ when versions were skipped or the update is gone;
- the next step applies it in place, as ``protocol.merge.merged`` defines: included
  ``θ ← θ_new + (θ − S)``, late or absent ``θ ← θ_new + (θ − B)``, rejected ``θ ← θ_new``
  (``alpha``: ``θ ← α·θ + (1 − α)·θ_new``), and ``θ_new`` becomes the base.

The publisher task encodes ``S − B`` in a worker thread, uploads the blob and then the
snapshot object. A publish that fails keeps its steps counted for the fragment's next round.
"""

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream
from torch import Tensor

from gradientmail._node.runtime import Runtime
from gradientmail.errors import GradientmailError, RecordError
from gradientmail.events.kinds import (
    Event,
    PollFailed,
    PublishFailed,
    RoundRecorded,
    SnapshotPublished,
    SnapshotRejected,
    StepsDropped,
)
from gradientmail.protocol import keys
from gradientmail.protocol.codec import decode_fragment, encode_fragment
from gradientmail.protocol.merge import Ledger, Outcome, Resolution
from gradientmail.protocol.records import (
    FragmentSpec,
    MergeRule,
    RoundRecord,
    RunConfig,
    Snapshot,
)

__all__ = [
    "FragmentState",
    "Job",
    "LearnerState",
    "Published",
    "Ready",
    "StateCell",
    "merge_in_place",
    "run_publisher",
    "run_receive",
]

_log = logging.getLogger("gradientmail.learner")


@dataclass(frozen=True, slots=True)
class Published:
    """A snapshot of a fragment handed to the publisher: for ``round``, taken after local
    step ``step``, holding ``snapshot`` (S). ``outcome`` is set once the round's record is
    folded."""

    round: int
    step: int
    snapshot: tuple[Tensor, ...]
    outcome: Outcome | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """Version ``version`` of a fragment, committed by ``round``, downloaded and decoded:
    ``theta`` (fp32, CPU), waiting for the next step to apply it."""

    round: int
    version: int
    theta: tuple[Tensor, ...]


@dataclass(frozen=True, slots=True)
class FragmentState:
    """One fragment as this learner holds it (see the module docstring). ``wanted`` is the
    newest record of the fragment not yet downloaded."""

    version: int
    base: tuple[Tensor, ...]
    published: Published | None = None
    in_flight: bool = False
    ready: Ready | None = None
    wanted: RoundRecord | None = None

    @property
    def blocked(self) -> bool:
        """Whether a snapshot must wait: one is in flight or an alignment is pending."""
        return (
            self.in_flight
            or self.published is not None
            or self.ready is not None
            or self.wanted is not None
        )


@dataclass(frozen=True, slots=True)
class LearnerState:
    """The learner's whole state: the step accounting, the local step and token counts, the
    fragments, and the newest round whose record it has folded (-1: none)."""

    ledger: Ledger
    step: int
    tokens: int
    fragments: tuple[FragmentState, ...]
    newest_round: int

    def _with(self, fragment: int, state: FragmentState) -> tuple[FragmentState, ...]:
        fragments = list(self.fragments)
        fragments[fragment] = state
        return tuple(fragments)

    def stepped(self, tokens: int) -> "LearnerState":
        return replace(
            self,
            ledger=self.ledger.stepped(tokens),
            step=self.step + 1,
            tokens=self.tokens + tokens,
        )

    def published(self, fragment: int, snapshot: tuple[Tensor, ...]) -> tuple["LearnerState", int]:
        """Hand a snapshot of ``fragment`` to the publisher; returns the round it targets."""
        current = self.fragments[fragment]
        round = keys.round_of(fragment, current.version + 1, len(self.fragments))
        entry = replace(
            current,
            published=Published(round=round, step=self.step, snapshot=snapshot),
            in_flight=True,
        )
        return (
            replace(
                self,
                ledger=self.ledger.published(fragment, round),
                fragments=self._with(fragment, entry),
            ),
            round,
        )

    def publish_done(self, fragment: int, round: int, ok: bool) -> "LearnerState":
        """The publisher finished with ``fragment``'s snapshot for ``round``."""
        current = self.fragments[fragment]
        entry = replace(current, in_flight=False)
        ledger = self.ledger
        published = current.published
        failed = not ok and published is not None and published.round == round
        if failed and published is not None and published.outcome is None:
            entry = replace(entry, published=None)
            ledger = ledger.publish_failed(fragment)
        return replace(self, ledger=ledger, fragments=self._with(fragment, entry))

    def publishing(self, record: RoundRecord) -> bool:
        """Whether this learner's snapshot for ``record``'s round is still being written.

        Until the write returns, a participant named like this learner in the record may be
        an earlier life's snapshot under the same key (the write then finds other bytes there
        and fails), so the record is folded only after it."""
        entry = self.fragments[record.fragment]
        published = entry.published
        return entry.in_flight and published is not None and published.round == record.round

    def recorded(self, record: RoundRecord, learner: str) -> tuple["LearnerState", list[Event]]:
        """Fold ``record`` (the next round in order): step accounting, the outcome of this
        learner's snapshot in it, and the download it calls for."""
        ledger, resolution = self.ledger.recorded(record, learner)
        events: list[Event] = []
        if resolution is not None:
            events.extend(resolution_events(resolution, learner))
        current = self.fragments[record.fragment]
        entry = current
        if current.published is not None and current.published.round == record.round:
            outcome: Outcome = "late"
            if any(p.learner == learner for p in record.participants):
                outcome = "included"
            elif any(r.learner == learner for r in record.rejected):
                outcome = "rejected"
            entry = replace(entry, published=replace(current.published, outcome=outcome))
        if record.version > current.version:
            entry = replace(entry, wanted=record)
        return (
            replace(
                self,
                ledger=ledger,
                fragments=self._with(record.fragment, entry),
                newest_round=max(self.newest_round, record.round),
            ),
            events,
        )

    def prepared(self, fragment: int, ready: Ready) -> "LearnerState":
        current = self.fragments[fragment]
        wanted = current.wanted
        if wanted is not None and wanted.version <= ready.version:
            wanted = None
        return replace(
            self, fragments=self._with(fragment, replace(current, ready=ready, wanted=wanted))
        )

    def aligned(self, fragment: int) -> "LearnerState":
        """The pending alignment of ``fragment`` was applied: its θ is the new base."""
        current = self.fragments[fragment]
        assert current.ready is not None
        published = current.published
        if published is not None and published.round <= current.ready.round:
            published = None
        entry = replace(
            current,
            version=current.ready.version,
            base=current.ready.theta,
            published=published,
            ready=None,
        )
        return replace(self, fragments=self._with(fragment, entry))


def resolution_events(resolution: Resolution, learner: str) -> list[Event]:
    """The events of one ``Ledger`` resolution: a rejected snapshot is reported
    (``SnapshotRejected``) and so are the steps dropped with it (``StepsDropped``)."""
    reason = resolution.reason
    if resolution.outcome != "rejected" or reason is None:
        return []
    return [
        SnapshotRejected(
            learner,
            resolution.round,
            resolution.fragment,
            reason,
            resolution.steps,
            resolution.tokens,
        ),
        StepsDropped(
            learner,
            resolution.fragment,
            resolution.steps,
            resolution.tokens,
            "rejected",
            f"rejected by round {resolution.round}: {reason}",
        ),
    ]


def merge_in_place(
    params: Sequence[Tensor],
    outcome: Outcome,
    *,
    theta: Sequence[Tensor],
    snapshot: Sequence[Tensor] | None,
    base: Sequence[Tensor],
    rule: MergeRule,
    alpha: float,
    non_blocking: bool = False,
) -> None:
    """Apply a new version ``theta`` of a fragment to its live ``params``, in place, with
    exactly the values ``protocol.merge.merged`` returns (bit for bit): keep-progress
    ``θ_new + (θ − S)`` when included, ``θ_new + (θ − B)`` when late, ``θ_new`` when
    rejected; ``α·θ + (1 − α)·θ_new`` under the alpha rule. ``theta``, ``snapshot`` and
    ``base`` live on the CPU and are copied to each parameter's device.
    """
    with torch.no_grad():
        for i, param in enumerate(params):
            new = theta[i].to(param.device, non_blocking=non_blocking)
            if rule == "alpha":
                param.copy_(torch.add(new.mul(1.0 - alpha), param, alpha=alpha))
            elif outcome == "rejected":
                param.copy_(new)
            else:
                reference = snapshot if outcome == "included" else base
                if reference is None:
                    raise ValueError("an included merge needs the snapshot")
                param.sub_(reference[i].to(param.device, non_blocking=non_blocking)).add_(new)


class StateCell:
    """Holds the node's current ``LearnerState``; read and replaced on the event-loop thread
    only (by the step, the receive task and the publisher task)."""

    def __init__(self, state: LearnerState) -> None:
        self.value = state


# -- the receive task -------------------------------------------------------------------------


async def run_receive(rt: Runtime, cell: StateCell, pin: bool, wake: Callable[[], None]) -> None:
    """List ``records/`` after the newest folded round every ``poll_interval``; fold each new
    record (``RoundRecorded``, and the accounting events), then prepare the newest version of
    each fragment for the next step. A failed iteration is reported (``PollFailed``) and
    retried at the next poll. ``wake`` is called after each iteration that changed the
    state."""
    while True:
        try:
            changed = await _receive_once(rt, cell, pin)
        except GradientmailError as exc:
            rt.emit(PollFailed(rt.learner, exc))
        else:
            if changed:
                wake()
        await rt.clock.sleep(rt.options.poll_interval)


async def _receive_once(rt: Runtime, cell: StateCell, pin: bool) -> bool:
    """Fold the new records in order and prepare the newest versions. A gap in the records
    or a record that does not decode or verify (damaged, or forged into a round ahead) stops
    the folding there; what was folded is still prepared, then the error is raised."""
    changed = False
    problem: RecordError | None = None
    for round in await rt.store.record_rounds(after=cell.value.newest_round):
        if round != cell.value.newest_round + 1:
            problem = RecordError(
                f"records/ jumps from round {cell.value.newest_round} to {round}; "
                "rounds are committed in order, so the store is damaged"
            )
            break
        try:
            record = await rt.store.record(round)
            if record is not None:
                _check(record, round, rt.config)
        except RecordError as exc:
            problem = exc
            break
        if record is None or cell.value.publishing(record):
            break
        rt.emit(RoundRecorded(rt.learner, record))
        cell.value, events = cell.value.recorded(record, rt.learner)
        for event in events:
            rt.emit(event)
        changed = True
    for fragment, entry in enumerate(cell.value.fragments):
        if entry.wanted is None or entry.ready is not None:
            continue
        ready = await _download(rt, fragment, entry, pin)
        if ready is not None:
            cell.value = cell.value.prepared(fragment, ready)
            changed = True
    if problem is not None:
        raise problem
    return changed


def _check(record: RoundRecord, round: int, config: RunConfig) -> None:
    if (
        record.round != round
        or record.fragment != keys.fragment_of(round, config.fragments)
        or record.version != keys.version_of(round, config.fragments)
    ):
        raise RecordError(f"records/{round:010d} does not describe round {round}")


async def _download(rt: Runtime, fragment: int, entry: FragmentState, pin: bool) -> Ready | None:
    """θ of ``entry.wanted``: the base plus the update when it is the next version and the
    update is there, else the record's θ; None when both are gone (a newer record exists
    and the next poll finds it)."""
    record = entry.wanted
    assert record is not None
    spec = rt.specs[fragment]
    if record.version == entry.version + 1:
        update = await rt.store.get_blob(record.update)
        if update is not None:
            theta = await anyio.to_thread.run_sync(_apply_update, entry.base, update, spec, pin)
            return Ready(round=record.round, version=record.version, theta=theta)
    data = await rt.store.get_blob(record.theta)
    if data is None:
        _log.info("%s: θ of round %d is gone; waiting for a newer record", rt.learner, record.round)
        return None
    theta = await anyio.to_thread.run_sync(_decode, data, spec, pin)
    return Ready(round=record.round, version=record.version, theta=theta)


def _pinned(tensors: Sequence[Tensor], pin: bool) -> tuple[Tensor, ...]:
    return tuple(t.pin_memory() if pin else t for t in tensors)


def _apply_update(
    base: Sequence[Tensor], data: bytes, spec: FragmentSpec, pin: bool
) -> tuple[Tensor, ...]:
    update = decode_fragment(data, spec)
    return _pinned([b + u for b, u in zip(base, update, strict=True)], pin)


def _decode(data: bytes, spec: FragmentSpec, pin: bool) -> tuple[Tensor, ...]:
    return _pinned(decode_fragment(data, spec), pin)


# -- the publisher task -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One snapshot to publish: ``S − B`` of ``fragment`` for ``round``. ``ready`` is the
    CUDA event after which ``snapshot`` holds its values (None on the CPU)."""

    fragment: int
    round: int
    base_version: int
    base: tuple[Tensor, ...]
    snapshot: tuple[Tensor, ...]
    ready: Any
    steps: int
    tokens: int


def _encode_delta(job: Job, spec: FragmentSpec, config: RunConfig) -> tuple[bytes, float | None]:
    if job.ready is not None:
        job.ready.synchronize()
    delta = [s.to(torch.float32) - b for s, b in zip(job.snapshot, job.base, strict=True)]
    norm = math.sqrt(sum(float(torch.sum(d * d)) for d in delta))
    data = encode_fragment(delta, spec, config.delta_encoding, block_size=config.block_size)
    return data, norm if math.isfinite(norm) else None


PUBLISH_ATTEMPTS = 5
"""Tries of each request of a publish before it counts as failed."""


async def run_publisher(
    rt: Runtime,
    cell: StateCell,
    jobs: MemoryObjectReceiveStream[Job],
    wake: Callable[[], None],
) -> None:
    """Publish each job in turn (see the module docstring); ``SnapshotPublished`` or
    ``PublishFailed``. Ends when the stream is closed and drained."""
    async with jobs:
        async for job in jobs:
            started = time.monotonic()
            ok = False
            try:
                spec = rt.specs[job.fragment]
                data, norm = await anyio.to_thread.run_sync(_encode_delta, job, spec, rt.config)
                ref = await rt.store.put_blob(data, rt.config.delta_encoding)
                snapshot = Snapshot(
                    learner=rt.learner,
                    round=job.round,
                    fragment=job.fragment,
                    base_version=job.base_version,
                    steps=job.steps,
                    tokens=job.tokens,
                    delta=ref,
                    norm=norm,
                )
                if not await rt.store.put_snapshot(snapshot):
                    raise RecordError(
                        f"{keys.snapshot(job.round, rt.learner)} already holds another "
                        "snapshot (an earlier run of this learner id, or a forgery); these "
                        "steps go out with the fragment's next round"
                    )
                ok = True
                rt.emit(
                    SnapshotPublished(
                        rt.learner,
                        job.round,
                        job.fragment,
                        job.steps,
                        job.tokens,
                        len(data),
                        time.monotonic() - started,
                    )
                )
            except GradientmailError as exc:
                rt.emit(PublishFailed(rt.learner, job.round, exc))
            finally:
                cell.value = cell.value.publish_done(job.fragment, job.round, ok)
                wake()
