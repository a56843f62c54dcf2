"""The inputs of the pure learner (``protocol.learner``): one tagged union of frozen values,
``Input``, each fed through ``Learner.handle``. The node's driver feeds them, a sharded
learner group's log carries them from the leader to every rank (``protocol.group``:
``encode_log``/``decode_log``, tagged JSON), and the tests speak them: an input is written
once, here, and handled once, in ``Learner.handle``.

Two inputs carry tensors (``VersionReady``'s θ, ``BeganClosing``'s models): each rank holds
its own rows of them, so the log carries them without (``without_tensors``; the fields are
then left out of the bytes) and a rank that replays the log puts its own back."""

from typing import TypeAlias

import msgspec

from gradientmail.protocol.learner_values import Failure, Stage, Tensors
from gradientmail.protocol.records import DropReason, RoundRecord

__all__ = [
    "BeganClosing",
    "DownloadFailed",
    "DroppedAll",
    "Finalized",
    "Flushed",
    "Input",
    "PublishEnded",
    "RecordSeen",
    "Stepped",
    "Synced",
    "VersionReady",
    "without_tensors",
]


class Stepped(msgspec.Struct, frozen=True, tag="step"):
    """One local optimizer step that consumed ``tokens``, at time ``now``."""

    tokens: int
    now: float


class Flushed(msgspec.Struct, frozen=True, tag="flush"):
    """One turn of the closing flush, at time ``now``: apply what is prepared (at once,
    whatever ``overlap`` says) and snapshot every fragment that can be."""

    now: float


class Synced(msgspec.Struct, frozen=True, tag="synced"):
    """The step just counted waited for the version of its own snapshot's round, at time
    ``now`` (``RunConfig.overlap`` 0): apply what is prepared, as a step would, without
    counting one."""

    now: float


class RecordSeen(msgspec.Struct, frozen=True, tag="record"):
    """The record of round ``seen_round + 1``, seen at ``now`` (records are fed in order,
    each once; any other round raises ``ValueError``)."""

    record: RoundRecord
    now: float


class VersionReady(msgspec.Struct, frozen=True, tag="ready", omit_defaults=True):
    """The download of round ``round``'s version of ``fragment`` gave ``theta`` (a rank's own
    rows of it; empty in a group's log)."""

    fragment: int
    round: int
    theta: Tensors = ()


class DownloadFailed(msgspec.Struct, frozen=True, tag="failed"):
    """The ``stage`` blob of round ``round``'s record of ``fragment`` was ``failure``
    (``detail``)."""

    fragment: int
    round: int
    stage: Stage
    failure: Failure
    detail: str


class PublishEnded(msgspec.Struct, frozen=True, tag="published"):
    """The publish of the snapshot of ``fragment`` for ``round`` ended: in the store
    (``ok``), or not (its steps go out with the fragment's next snapshot). In a sharded
    group: the learner's snapshot, all its parts."""

    fragment: int
    round: int
    ok: bool


class BeganClosing(msgspec.Struct, frozen=True, tag="closing", omit_defaults=True):
    """Closing with flush began with the live model ``models`` (one tuple per fragment: a
    rank's own rows; empty in a group's log). Another count than the run's fragments raises
    ``ValueError``."""

    models: tuple[Tensors, ...] = ()


class Finalized(msgspec.Struct, frozen=True, tag="finalize"):
    """Closing has settled (or may have): publish the final snapshots now due."""


class DroppedAll(msgspec.Struct, frozen=True, tag="dropped"):
    """Give up every fragment's local steps, for ``reason`` (closing without a flush, or
    giving up)."""

    reason: DropReason
    detail: str


Input: TypeAlias = (
    Stepped
    | Synced
    | Flushed
    | RecordSeen
    | VersionReady
    | DownloadFailed
    | PublishEnded
    | BeganClosing
    | Finalized
    | DroppedAll
)
"""One input of the learner (``Learner.handle``)."""


def without_tensors(input: Input) -> Input:
    """``input`` as a group's log carries it: its tensors left out (each rank has its own)."""
    match input:
        case VersionReady():
            return VersionReady(input.fragment, input.round)
        case BeganClosing():
            return BeganClosing()
    return input
