"""The control messages of a learner group (``docs/node.md``, "Learner groups"), as pure
values: what each rank contributes, how the group's sum reads back, and whether the group
is still in step.

A learner group is a ``torch.distributed`` process group whose ranks form one learner.
Every control exchange is one all-reduce (sum) of a fixed-shape int64 vector: each rank adds
one message, and the leader (rank 0) adds its decision. A ``step`` is one exchange: the
leader has already run the learner's step with the tokens every rank passes (the learner's,
the same on every rank: the sum checks it) and sends what it decided. Because every
exchange has the same shape, whatever a rank sends (its step, its close, or the abort of a
rank leaving by an exception) matches whatever exchange the other ranks are waiting in, so
an abort reaches them wherever they are, and the sum says who was where.

Layout (``width(fragments)`` ints): one count per message kind (``KINDS``), the sum of the
aborting ranks, the tokens, then the leader's decision: present, ok, newest round + 1,
aligned round + 1, the leader's tokens, one version per fragment.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "KINDS",
    "Decision",
    "Kind",
    "Message",
    "Summed",
    "contribution",
    "read",
    "verdict",
    "width",
]

Kind: TypeAlias = Literal["enter", "step", "close", "result", "abort"]
KINDS: tuple[Kind, ...] = ("enter", "step", "close", "result", "abort")
_ABORT_RANKS = len(KINDS)
_TOKENS = _ABORT_RANKS + 1
_DECISION = _TOKENS + 1
_HEAD = _DECISION + 5


@dataclass(frozen=True, slots=True)
class Decision:
    """What the leader decided, the same on every rank once exchanged: the version of each
    fragment the learner holds (a fragment whose version changed is re-sent from the leader),
    the newest round seen, the newest round among the versions, the tokens the leader's step
    counted, and whether the leader's part succeeded (its close, for a ``result``)."""

    versions: tuple[int, ...]
    round: int
    aligned: int
    tokens: int = 0
    ok: bool = True

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
    and (the leader's only) a ``decision``."""

    kind: Kind
    rank: int
    tokens: int = 0
    decision: Decision | None = None


@dataclass(frozen=True, slots=True)
class Summed:
    """An exchange read back: how many ranks sent each kind, the sum of the aborting ranks,
    the group's tokens, and the leader's decision (None when it sent none)."""

    counts: dict[Kind, int]
    abort_ranks: int
    tokens: int
    decision: Decision | None


def width(fragments: int) -> int:
    """The length of the control vector of a run of ``fragments`` fragments."""
    return _HEAD + fragments


def contribution(message: Message, fragments: int) -> list[int]:
    """The ints ``message`` adds to the exchange. Raises ``ValueError`` for negative tokens
    or a decision of another fragment count."""
    if message.tokens < 0 or (message.decision is not None and message.decision.tokens < 0):
        raise ValueError(f"tokens must be non-negative, got {message}")
    values = [0] * width(fragments)
    values[KINDS.index(message.kind)] = 1
    if message.kind == "abort":
        values[_ABORT_RANKS] = message.rank
    values[_TOKENS] = message.tokens
    decision = message.decision
    if decision is not None:
        if len(decision.versions) != fragments:
            raise ValueError(f"a decision of a {fragments}-fragment run needs {fragments} versions")
        values[_DECISION : _HEAD + fragments] = [
            1,
            int(decision.ok),
            decision.round + 1,
            decision.aligned + 1,
            decision.tokens,
            *decision.versions,
        ]
    return values


def read(values: Sequence[int], fragments: int) -> Summed:
    """The exchange whose summed vector is ``values``. Raises ``ValueError`` for a vector of
    another length, or one where more than one rank decided."""
    if len(values) != width(fragments):
        raise ValueError(f"a control vector of {fragments} fragments has {width(fragments)} ints")
    counts = {kind: int(values[i]) for i, kind in enumerate(KINDS)}
    present = int(values[_DECISION])
    if present > 1:
        raise ValueError(f"{present} ranks sent a decision; only the leader (rank 0) decides")
    decision = None
    if present:
        decision = Decision(
            versions=tuple(int(v) for v in values[_HEAD : _HEAD + fragments]),
            round=int(values[_DECISION + 2]) - 1,
            aligned=int(values[_DECISION + 3]) - 1,
            tokens=int(values[_DECISION + 4]),
            ok=bool(values[_DECISION + 1]),
        )
    return Summed(counts, int(values[_ABORT_RANKS]), int(values[_TOKENS]), decision)


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
