"""What a node reports while it runs: one frozen value per kind of event.

Every report a learner or a syncer makes is an event: a frozen, slotted dataclass naming the
``learner`` it happened on (one process may host several nodes), followed by the facts of
the report. Error fields hold the exception object itself, never its text, so a sink can
render the traceback. Events are plain values: building one does no I/O and takes no lock,
so they may be built on any thread.

``LearnerEvent``, ``SyncerEvent`` and ``Event`` are unions of the kinds, made for ``match``
with ``typing.assert_never`` in the last case: the type checker then flags a kind a
``match`` forgot (``sinks.level`` is such a function).

Pure: no I/O, no event loop.
"""

import re
from dataclasses import dataclass
from typing import Literal, TypeAlias

from gradientmail.protocol.config import Pattern
from gradientmail.protocol.records import (
    DropReason,
    RejectReason,
    RoundRecord,
    RoundRecordDraft,
)

__all__ = [
    "KINDS",
    "WAITING_WARNING",
    "AwaitingCreator",
    "Closed",
    "Closing",
    "CreatingRun",
    "DropReason",
    "Event",
    "EventsDropped",
    "FollowingRound",
    "FragmentAligned",
    "GaveUp",
    "Joined",
    "LearnerEvent",
    "LeaseReleased",
    "PollFailed",
    "PublishCancelled",
    "PublishFailed",
    "Recovered",
    "RecoveryFailed",
    "ReleaseFailed",
    "RoundClaimed",
    "RoundClosed",
    "RoundCommitted",
    "RoundFailed",
    "RoundIncomplete",
    "RoundRecorded",
    "RoundSuperseded",
    "SnapshotPublished",
    "SnapshotRejected",
    "StepsDropped",
    "SyncerEvent",
    "SyncerStopped",
    "Takeover",
    "TookOverCreation",
    "TookOverRound",
    "Waiting",
    "kind_name",
]


@dataclass(frozen=True, slots=True)
class CreatingRun:
    """This node holds the creation claim and is uploading Θ⁰ of ``fragments`` fragments,
    split by ``pattern`` into fragments of ``sizes`` parameters (elements, in fragment
    order)."""

    learner: str
    fragments: int
    pattern: Pattern
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AwaitingCreator:
    """``claimants`` hold the creation claim; this node polls for the manifest."""

    learner: str
    claimants: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TookOverCreation:
    """No init payload landed for ``stalled`` seconds; this node took the next creation
    claim."""

    learner: str
    stalled: float


@dataclass(frozen=True, slots=True)
class Joined:
    """The model holds the newest committed version of every fragment of the run
    ``created_by`` created; ``round`` is the newest committed round, -1 on a fresh run."""

    learner: str
    created_by: str
    fragments: int
    round: int


@dataclass(frozen=True, slots=True)
class FragmentAligned:
    """``fragment`` now holds ``version``, committed by ``round``, applied at ``local_step``;
    ``lag_steps`` is how many steps that is after this learner's snapshot in the round, None
    when it took no part in it."""

    learner: str
    round: int
    fragment: int
    version: int
    local_step: int
    lag_steps: int | None


@dataclass(frozen=True, slots=True)
class SnapshotPublished:
    """The delta of ``fragment`` for ``round``, ``steps`` steps and ``tokens`` tokens, is in
    the store: ``size`` bytes in ``seconds``."""

    learner: str
    round: int
    fragment: int
    steps: int
    tokens: int
    size: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PublishFailed:
    """Publishing ``round`` failed; its steps stay counted and go out with the fragment's
    next round."""

    learner: str
    round: int
    error: Exception


@dataclass(frozen=True, slots=True)
class PollFailed:
    """A receive iteration failed; the next poll retries it."""

    learner: str
    error: Exception


@dataclass(frozen=True, slots=True)
class RoundRecorded:
    """The receive loop listed ``record``, whichever node committed it. Every node reports
    every round committed after it joined, whether or not it aligns with that version: a
    newer one of the same fragment in the same listing replaces it."""

    learner: str
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class SnapshotRejected:
    """The committed ``round`` of ``fragment`` rejected this learner's snapshot for
    ``reason`` (a ``RejectReason``); its ``steps`` steps and ``tokens`` tokens are dropped
    with it and will never reach the model."""

    learner: str
    round: int
    fragment: int
    reason: RejectReason
    steps: int
    tokens: int


@dataclass(frozen=True, slots=True)
class StepsDropped:
    """``steps`` local steps and ``tokens`` tokens of ``fragment`` will never reach a round,
    for ``reason``: ``"rejected"`` when the round that carried them rejected the snapshot,
    ``"reset"`` when that rejection reset the fragment to the global θ and so wiped the
    steps taken since, ``"closed-without-flush"`` when the node closed without publishing
    them (an exception, a cancellation, a failure of the node), ``"gave-up"`` when
    ``close()`` stopped waiting for the round that carried them, ``"behind"`` when closing
    began with the learner's model more than a cycle of the others' rounds behind theirs
    (it stood still through them; docs/protocol.md, "The last round of a run"). ``detail``
    says more in words (which round, which rejection)."""

    learner: str
    fragment: int
    steps: int
    tokens: int
    reason: DropReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Closing:
    """The node began to close: with ``flushing``, it publishes the steps since each
    fragment's last round and waits for their rounds (leaving the block normally); without,
    it publishes nothing more and drops those steps (leaving by an exception, a
    cancellation or a failure of the node)."""

    learner: str
    flushing: bool


@dataclass(frozen=True, slots=True)
class Closed:
    """Every round this learner published, up to ``round``, is committed and the model is
    aligned with it."""

    learner: str
    round: int


@dataclass(frozen=True, slots=True)
class GaveUp:
    """``close()`` stopped waiting for ``round`` after nothing landed for ``waited``
    seconds; the model is aligned up to round ``aligned``."""

    learner: str
    round: int
    waited: float
    aligned: int


@dataclass(frozen=True, slots=True)
class PublishCancelled:
    """The publisher was still publishing ``waited`` seconds after the last rounds and was
    cancelled."""

    learner: str
    waited: float


@dataclass(frozen=True, slots=True)
class LeaseReleased:
    """This node's lease is released: the others stop counting it as live at once instead of
    when it expires."""

    learner: str


@dataclass(frozen=True, slots=True)
class ReleaseFailed:
    """Releasing the lease failed; the others stop counting this node once it expires."""

    learner: str
    error: Exception


@dataclass(frozen=True, slots=True)
class Recovered:
    """The syncer rebuilt a closer's state from the store; ``round`` is the next to run."""

    learner: str
    round: int


@dataclass(frozen=True, slots=True)
class RecoveryFailed:
    """Rebuilding a closer's state failed; it is retried in ``retry_in`` seconds."""

    learner: str
    error: Exception
    retry_in: float


@dataclass(frozen=True, slots=True)
class RoundClaimed:
    """This node made the first claim on ``round`` and closes it."""

    learner: str
    round: int


@dataclass(frozen=True, slots=True)
class FollowingRound:
    """``claimants`` hold ``round``; this node waits for its record and takes over once the
    last claimant's lease ends or no record lands within ``timeout`` seconds."""

    learner: str
    round: int
    claimants: tuple[str, ...]
    timeout: float


Takeover: TypeAlias = Literal["lease_gone", "no_record"]
"""Why a node took over a round: the last claimant's lease ended, or no record landed in
time."""


@dataclass(frozen=True, slots=True)
class TookOverRound:
    """This node took the next claim on ``round``: the last of ``claimants`` lost its lease,
    or no record landed within ``timeout`` seconds."""

    learner: str
    round: int
    claimants: tuple[str, ...]
    cause: Takeover
    timeout: float


@dataclass(frozen=True, slots=True)
class RoundClosed:
    """This node closed ``draft.round`` and commits it next; the participants with their
    weights, the rejected snapshots and the realized waits are in ``draft``."""

    learner: str
    draft: RoundRecordDraft


@dataclass(frozen=True, slots=True)
class RoundCommitted:
    """This node wrote ``record``, its payloads and the record itself in ``seconds``."""

    learner: str
    record: RoundRecord
    seconds: float


@dataclass(frozen=True, slots=True)
class RoundSuperseded:
    """Another node committed the round first; ``record`` is theirs and this node follows on
    from it."""

    learner: str
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class RoundFailed:
    """Closing or following ``round`` failed; it is retried as after a restart in
    ``retry_in`` seconds."""

    learner: str
    round: int
    error: Exception
    retry_in: float


@dataclass(frozen=True, slots=True)
class SyncerStopped:
    """The syncer task died of ``error``; the node fails with it (the next ``step()``
    raises it)."""

    learner: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class RoundIncomplete:
    """This node closed ``round`` without the live learners ``missing`` (their leases were
    live, they had no snapshot in it); ``empty`` when nobody had published to it. Rounds that
    keep closing so are a run whose learners have drifted apart."""

    learner: str
    round: int
    missing: tuple[str, ...]
    empty: bool


@dataclass(frozen=True, slots=True)
class Waiting:
    """This learner spent ``share`` of its time over about its last fragment period waiting
    on rounds (at the step that applies a round's version, in the repeatable mode: every
    learner then runs at the pace of the slowest); ``waiting_for`` names the learners whose
    snapshots the rounds it waited on took last (empty when no record said). Emitted at most
    once a period while the share stays over ``WAITING_WARNING``. The adaptive schedule
    (``RunConfig.overlap`` None) does not wait."""

    learner: str
    share: float
    waiting_for: tuple[str, ...]


WAITING_WARNING = 0.2
"""The share of its time a learner waits on rounds above which it reports ``Waiting``."""


@dataclass(frozen=True, slots=True)
class EventsDropped:
    """The sink or subscriber named ``sink`` fell behind and lost ``count`` events, all
    emitted just before this one; it is delivered to that sink alone, once it has room
    again."""

    learner: str
    sink: str
    count: int


LearnerEvent: TypeAlias = (
    CreatingRun
    | AwaitingCreator
    | TookOverCreation
    | Joined
    | FragmentAligned
    | SnapshotPublished
    | PublishFailed
    | PollFailed
    | RoundRecorded
    | SnapshotRejected
    | StepsDropped
    | Closing
    | Closed
    | GaveUp
    | PublishCancelled
    | LeaseReleased
    | ReleaseFailed
    | Waiting
)
"""What the learner side of a node reports: joining, aligning, publishing, closing."""

SyncerEvent: TypeAlias = (
    Recovered
    | RecoveryFailed
    | RoundClaimed
    | FollowingRound
    | TookOverRound
    | RoundClosed
    | RoundCommitted
    | RoundSuperseded
    | RoundFailed
    | SyncerStopped
    | RoundIncomplete
)
"""What the syncer side of a node reports: claiming, closing and committing rounds."""

Event: TypeAlias = LearnerEvent | SyncerEvent | EventsDropped
"""Every event a sink may receive: the node's, and the bus's own ``EventsDropped``."""

KINDS: tuple[type[Event], ...] = (
    CreatingRun,
    AwaitingCreator,
    TookOverCreation,
    Joined,
    FragmentAligned,
    SnapshotPublished,
    PublishFailed,
    PollFailed,
    RoundRecorded,
    SnapshotRejected,
    StepsDropped,
    Closing,
    Closed,
    GaveUp,
    PublishCancelled,
    LeaseReleased,
    ReleaseFailed,
    Waiting,
    Recovered,
    RecoveryFailed,
    RoundClaimed,
    FollowingRound,
    TookOverRound,
    RoundClosed,
    RoundCommitted,
    RoundSuperseded,
    RoundFailed,
    SyncerStopped,
    RoundIncomplete,
    EventsDropped,
)
"""Every kind of event, learner kinds first, then syncer kinds, then the bus's."""

_NAMES: dict[type[Event], str] = {
    kind: re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).lower() for kind in KINDS
}


def kind_name(event: Event) -> str:
    """The kind of ``event`` in snake_case (``RoundCommitted`` → ``"round_committed"``), as
    the ``event`` key of the JSON sink writes it."""
    return _NAMES[type(event)]
