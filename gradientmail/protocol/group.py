"""The control messages of a learner group (``docs/node.md``, "Learner groups"), as pure
values: what each rank contributes, how the group's sum reads back, and whether the group
is still in step.

Every control exchange is one all-reduce (sum) of a fixed-shape int64 vector of
``width(fragments)`` ints: one count per message kind (``KINDS``), the sum of the aborting
ranks, the tokens, the ranks with part reports to send, then the leader's decision (present,
ok, newest round + 1, aligned round + 1, the leader's tokens, the bytes of its log, whether
its close goes on, the bits of its step's clock reading as a float64, one version per
fragment), then per fragment the sum of every rank's prepared round and of their squares.
Every exchange has the same shape, so whatever a rank sends (its step, its close, the abort
of a rank leaving by an exception) matches whatever exchange the others wait in, and the sum
says who was where.

A sharded group (FSDP2) keeps one pure learner per rank in step by the leader's log
(``encode_log``/``decode_log``): every input (``protocol.learner_inputs.Input``) the
leader's learner took since the last exchange, in order, without tensors. The log lives only
in the exchanges between the group's ranks (one version of gradientmail on every rank);
nothing stores it. The step's tokens and clock reading travel in the decision
(``Decision.stepped``). Every rank holds the round ``w`` the leader wants exactly when the
sums are ``W·w`` and ``W·w²`` (``all_ready``: Σ(r − w)² is 0 only then), and only then does
the leader feed (and log) ``VersionReady``.
"""

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import msgspec

from gradientmail.protocol.learner import Learner
from gradientmail.protocol.learner_inputs import Input, Stepped
from gradientmail.protocol.records import DECODE_FAILURES, SnapshotPart

__all__ = [
    "KINDS",
    "Decision",
    "Gathered",
    "Kind",
    "Message",
    "PartReport",
    "Summed",
    "all_ready",
    "contribution",
    "decode_log",
    "encode_log",
    "read",
    "verdict",
    "width",
]

Kind: TypeAlias = Literal["enter", "step", "close", "result", "abort"]
KINDS: tuple[Kind, ...] = ("enter", "step", "close", "result", "abort")
_ABORT_RANKS = len(KINDS)
_TOKENS = _ABORT_RANKS + 1
_REPORTS = _TOKENS + 1
_DECIDED = 8
"""The decision's fields before its versions: present, ok, round + 1, aligned + 1, tokens,
log bytes, closing, the step's clock reading."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the leader decided, the same on every rank once exchanged: the version of each
    fragment the learner holds (a fragment whose version changed is re-sent from the leader
    in a replicated group), the newest round seen, the newest round among the versions, the
    tokens the leader's step counted, whether the leader's part succeeded (its close, for a
    ``result``), the bytes of the log that follows the exchange, while a sharded group
    closes whether the leader's close goes on (``closing``: the ranks tick again), and the
    leader's clock reading at its step (``now``; a sharded group replays
    ``stepped`` after the log)."""

    versions: tuple[int, ...]
    round: int
    aligned: int
    tokens: int = 0
    ok: bool = True
    log: int = 0
    closing: bool = False
    now: float = 0.0

    @classmethod
    def of(cls, learner: Learner, tokens: int = 0) -> "Decision":
        """What ``learner`` holds now, as the leader decides it: its versions, newest round
        and aligned round, with the ``tokens`` of its step."""
        return cls(learner.versions, learner.newest_round, learner.aligned_round, tokens)

    @property
    def stepped(self) -> "Stepped":
        """The leader's step as its learner took it."""
        return Stepped(self.tokens, self.now)

    def changed(self, previous: "Decision") -> tuple[int, ...]:
        """The fragments whose version differs from ``previous``'s."""
        return tuple(
            f
            for f, (new, old) in enumerate(zip(self.versions, previous.versions, strict=True))
            if new != old
        )


@dataclass(frozen=True, slots=True)
class Message:
    """One rank's part of an exchange: its ``kind``, its ``rank``, the tokens of its step,
    (the leader's only) a ``decision``, and in a sharded group whether it has part reports
    to send and the round of the version of each fragment it has ``prepared`` (None: none;
    an empty tuple for no readiness at all)."""

    kind: Kind
    rank: int
    tokens: int = 0
    decision: Decision | None = None
    reports: bool = False
    prepared: tuple[int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class Summed:
    """An exchange read back: how many ranks sent each kind, the sum of the aborting ranks,
    the group's tokens, the leader's decision (None when it sent none), how many ranks
    have part reports, and per fragment the sums of the ranks' prepared rounds and of their
    squares."""

    counts: dict[Kind, int]
    abort_ranks: int
    tokens: int
    decision: Decision | None
    reports: int = 0
    prepared: tuple[int, ...] = ()
    squares: tuple[int, ...] = ()


def _decision_at(fragments: int) -> int:
    return _REPORTS + 1


def _prepared_at(fragments: int) -> int:
    return _decision_at(fragments) + _DECIDED + fragments


def width(fragments: int) -> int:
    """The length of the control vector of a run of ``fragments`` fragments."""
    return _prepared_at(fragments) + 2 * fragments


def _bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def contribution(message: Message, fragments: int) -> list[int]:
    """The ints ``message`` adds to the exchange. Raises ``ValueError`` for negative tokens
    or log bytes, or a decision or readiness of another fragment count."""
    decision = message.decision
    if message.tokens < 0 or (decision is not None and min(decision.tokens, decision.log) < 0):
        raise ValueError(f"tokens and log bytes must be non-negative, got {message}")
    if message.prepared and len(message.prepared) != fragments:
        raise ValueError(f"the readiness of a {fragments}-fragment run has {fragments} rounds")
    values = [0] * width(fragments)
    at = _prepared_at(fragments)
    for fragment, round in enumerate(message.prepared):
        value = -1 if round is None else round
        values[at + fragment] = value
        values[at + fragments + fragment] = value * value
    values[KINDS.index(message.kind)] = 1
    if message.kind == "abort":
        values[_ABORT_RANKS] = message.rank
    values[_TOKENS] = message.tokens
    values[_REPORTS] = int(message.reports)
    if decision is not None:
        if len(decision.versions) != fragments:
            raise ValueError(f"a decision of a {fragments}-fragment run needs {fragments} versions")
        at = _decision_at(fragments)
        values[at : at + _DECIDED + fragments] = [
            1,
            int(decision.ok),
            decision.round + 1,
            decision.aligned + 1,
            decision.tokens,
            decision.log,
            int(decision.closing),
            _bits(decision.now),
            *decision.versions,
        ]
    return values


def read(values: Sequence[int], fragments: int) -> Summed:
    """The exchange whose summed vector is ``values``. Raises ``ValueError`` for a vector of
    another length, or one where more than one rank decided."""
    if len(values) != width(fragments):
        raise ValueError(f"a control vector of {fragments} fragments has {width(fragments)} ints")
    counts = {kind: int(values[i]) for i, kind in enumerate(KINDS)}
    at = _decision_at(fragments)
    present = int(values[at])
    if present > 1:
        raise ValueError(f"{present} ranks sent a decision; only the leader (rank 0) decides")
    decision = None
    if present:
        decision = Decision(
            versions=tuple(int(v) for v in values[at + _DECIDED : at + _DECIDED + fragments]),
            round=int(values[at + 2]) - 1,
            aligned=int(values[at + 3]) - 1,
            tokens=int(values[at + 4]),
            ok=bool(values[at + 1]),
            log=int(values[at + 5]),
            closing=bool(values[at + 6]),
            now=_float(int(values[at + 7])),
        )
    ready = _prepared_at(fragments)
    return Summed(
        counts,
        int(values[_ABORT_RANKS]),
        int(values[_TOKENS]),
        decision,
        reports=int(values[_REPORTS]),
        prepared=tuple(int(v) for v in values[ready : ready + fragments]),
        squares=tuple(int(v) for v in values[ready + fragments : ready + 2 * fragments]),
    )


def verdict(summed: Summed, expected: Kind, world: int) -> str | None:
    """None when all ``world`` ranks sent ``expected`` (and the leader decided, where it
    must); otherwise why the group cannot go on, for the ``GroupFailed`` every rank raises."""
    aborted = summed.counts["abort"]
    if aborted == 1:
        return f"rank {summed.abort_ranks} of the group left the block with an exception"
    if aborted > 1:
        return f"{aborted} ranks of the group left the block with an exception"
    if summed.counts[expected] != world:
        seen = ", ".join(f"{n} {kind}" for kind, n in summed.counts.items() if n)
        return (
            f"the ranks are out of step: expected {world} {expected}, got {seen}; every rank "
            "must call step() as often as the others and leave the block with them"
        )
    decision = summed.decision
    if expected in ("step", "result") and decision is None:
        return f"the leader (rank 0) sent no decision with its {expected}"
    if expected == "step" and decision is not None and summed.tokens != world * decision.tokens:
        return (
            f"the ranks passed different tokens to step(): {summed.tokens} in all, the leader "
            f"{decision.tokens}; every rank passes the learner's tokens (the whole group's "
            "batch), the same number"
        )
    return None


def all_ready(summed: Summed, wanted: Sequence[int | None], world: int) -> tuple[int, ...]:
    """The fragments whose ``wanted`` round (the leader's learner's; None: none wanted)
    every one of the ``world`` ranks has prepared, from the exchange's sums of the ranks'
    prepared rounds and of their squares (see the module docstring)."""
    return tuple(
        fragment
        for fragment, (total, squares, round) in enumerate(
            zip(summed.prepared, summed.squares, wanted, strict=True)
        )
        if round is not None and total == world * round and squares == world * round * round
    )


# -- the log of a sharded group --------------------------------------------------------------


_log_encoder = msgspec.json.Encoder()
_log_decoder = msgspec.json.Decoder(list[Input])


def encode_log(entries: Sequence[Input]) -> bytes:
    """The bytes the leader broadcasts after an exchange (empty for no entry); ``entries``
    carry no tensors (``learner_inputs.without_tensors``)."""
    return _log_encoder.encode(list(entries)) if entries else b""


def decode_log(data: bytes) -> list[Input]:
    """The entries of ``encode_log``'s bytes. Raises ``ValueError`` for bytes it did not
    write (the group's own ranks send them: a failure is a bug or a version mismatch)."""
    if not data:
        return []
    try:
        return _log_decoder.decode(data)
    except DECODE_FAILURES as exc:
        raise ValueError(f"a learner group's log does not decode: {exc}") from exc


# -- a snapshot's parts, gathered by the leader ------------------------------------------------


class PartReport(msgspec.Struct, frozen=True):
    """Rank ``rank``'s part of the learner's snapshot of ``fragment`` for ``round``: its blob
    and rows (None: its upload failed) and the squared L2 norm of its delta (None when not
    finite)."""

    rank: int
    round: int
    fragment: int
    part: SnapshotPart | None
    squares: float | None


@dataclass(frozen=True, slots=True)
class Gathered:
    """The parts of one snapshot so far, by rank (the leader's own included)."""

    world: int
    parts: tuple[PartReport | None, ...]

    @classmethod
    def empty(cls, world: int) -> "Gathered":
        return cls(world, (None,) * world)

    def add(self, report: PartReport) -> "Gathered":
        """With ``report``. Raises ``ValueError`` for a rank outside the group or a rank
        that reported twice (a bug: each rank uploads its part once)."""
        if not 0 <= report.rank < self.world:
            raise ValueError(f"rank {report.rank} is outside a group of {self.world}")
        if self.parts[report.rank] is not None:
            raise ValueError(f"rank {report.rank} reported its part twice")
        parts = list(self.parts)
        parts[report.rank] = report
        return Gathered(self.world, tuple(parts))

    @property
    def complete(self) -> bool:
        return all(part is not None for part in self.parts)

    @property
    def failed(self) -> tuple[int, ...]:
        """The ranks that reported their upload failed."""
        return tuple(
            rank for rank, report in enumerate(self.parts) if report and report.part is None
        )

    def snapshot_parts(self) -> tuple[tuple[SnapshotPart, ...], float | None]:
        """Every rank's part in rank order and the norm of the whole delta (None when a
        part's is not finite). Raises ``ValueError`` before every rank reported, or when
        some rank's upload failed."""
        if not self.complete or self.failed:
            missing = [rank for rank, part in enumerate(self.parts) if part is None]
            raise ValueError(f"ranks {missing} have not reported, {list(self.failed)} failed")
        reports = [part for part in self.parts if part is not None]
        parts = tuple(report.part for report in reports if report.part is not None)
        squares = [report.squares for report in reports]
        finite = [value for value in squares if value is not None]
        if len(finite) < len(squares):
            return parts, None
        return parts, math.sqrt(sum(finite))
