"""The learner's side of a round: how a new version merges with local progress, and the
accounting of every local step until a round carries it or it is dropped.

``merged`` applies version ``v+1`` of a fragment to the learner's ``local`` one by the
round's outcome for its snapshot: ``included`` keeps the progress since the snapshot,
``late`` all since its base, ``rejected`` none (``keep-progress``), an included ``topk``
snapshot adding back what its delta did not send (``kept``, ``protocol.feedback``);
``alpha`` mixes ``α·local + (1 − α)·θ`` whatever the outcome. The round of a closing
learner's final snapshot (``final``) leaves it on θ under either rule: a closing learner
takes no steps, and its final snapshot sent everything its weights held beyond θ. The
table: docs/protocol.md, "The learner's merge".

The accounting (``Ledger``, one ``FragmentLedger`` per fragment) is an immutable value with
pure transitions: it folds local steps, publishes (and failed ones) and every committed
record of the run in round order. For every fragment, at all times,
``committed + dropped + since_base == total`` (steps, and tokens), so every local step ends
in exactly one round's participants or one drop report.

Pure: no I/O. Which thread or task folds a ledger is the node's business; the value itself
is immutable and safe to share.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from gradientmail.protocol.config import MergeRule
from gradientmail.protocol.records import DropReason, RejectReason, RoundRecord

__all__ = [
    "Dropped",
    "FragmentLedger",
    "InFlight",
    "Ledger",
    "Merge",
    "Outcome",
    "Resolution",
    "Tally",
    "merge_into",
    "merged",
]

Outcome = Literal["included", "rejected", "late"]
"""What a round did with a learner's snapshot (see the module docstring)."""
Merge = Literal["included", "rejected", "late", "final"]
"""How a version merges: by the outcome for the learner's snapshot, or ``final``."""


def merge_into(
    params: Sequence[Tensor],
    outcome: Merge,
    *,
    theta: Sequence[Tensor],
    snapshot: Sequence[Tensor] | None,
    base: Sequence[Tensor] | None,
    rule: MergeRule,
    alpha: float,
    kept: Sequence[Tensor] | None = None,
    non_blocking: bool = False,
) -> None:
    """Replace the live fragment ``params`` by the learner's new fragment after a round (see
    the module docstring), in place: the one implementation of the merge, which the node
    runs on its parameters and ``merged`` on copies.

    ``theta``, ``snapshot``, ``base`` and ``kept`` may live on another device (the CPU);
    they are copied to each parameter's (``non_blocking`` from pinned memory). ``snapshot``
    is needed for ``included`` and ``base`` for ``late`` under ``keep-progress``; ``kept``
    (an included snapshot's unsent residual) is added after an ``included`` merge under
    ``keep-progress`` and ignored otherwise. Raises ``ValueError``, before changing anything,
    if the one needed is None, for mismatched tensors, an unknown outcome or rule, or
    ``alpha`` outside [0, 1].
    """
    reference = _reference(params, outcome, theta, snapshot, base, rule, alpha)
    added = kept if rule == "keep-progress" and outcome == "included" else None
    if added is not None:
        _same(theta, added, "kept")
    with torch.no_grad():
        for i, param in enumerate(params):
            new = theta[i].to(param.device, non_blocking=non_blocking)
            if rule == "alpha" and outcome != "final":
                param.copy_(torch.add(new.mul(1.0 - alpha), param, alpha=alpha))
            elif reference is None:
                param.copy_(new)
            else:
                param.sub_(reference[i].to(param.device, non_blocking=non_blocking)).add_(new)
            if added is not None:
                param.add_(added[i].to(param.device, non_blocking=non_blocking))


def _reference(
    local: Sequence[Tensor],
    outcome: Merge,
    theta: Sequence[Tensor],
    snapshot: Sequence[Tensor] | None,
    base: Sequence[Tensor] | None,
    rule: MergeRule,
    alpha: float,
) -> Sequence[Tensor] | None:
    """Check a merge's arguments; the tensors subtracted from ``local`` (None: none)."""
    if len(local) != len(theta):
        raise ValueError(f"local has {len(local)} tensors, theta {len(theta)}")
    for i, (a, b) in enumerate(zip(local, theta, strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"tensor {i}: local shape {list(a.shape)}, theta {list(b.shape)}")
    if rule == "alpha":
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        return None
    if rule != "keep-progress":
        raise ValueError(f"unknown merge rule {rule!r}: use 'keep-progress' or 'alpha'")
    if outcome in ("rejected", "final"):
        return None
    if outcome == "included":
        reference, name = snapshot, "snapshot"
    elif outcome == "late":
        reference, name = base, "base"
    else:
        raise ValueError(f"unknown outcome {outcome!r}")
    if reference is None:
        raise ValueError(f"a {outcome} merge needs the {name}, one tensor per parameter")
    _same(theta, reference, name)
    return reference


def _same(theta: Sequence[Tensor], tensors: Sequence[Tensor], name: str) -> None:
    """Raise ``ValueError`` unless ``tensors`` are one per parameter of ``theta``'s shapes."""
    if len(tensors) != len(theta):
        raise ValueError(f"the {name} has {len(tensors)} tensors, theta {len(theta)}")
    for i, (a, b) in enumerate(zip(tensors, theta, strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"tensor {i}: {name} shape {list(a.shape)}, theta {list(b.shape)}")


def merged(
    outcome: Merge,
    *,
    local: Sequence[Tensor],
    theta: Sequence[Tensor],
    snapshot: Sequence[Tensor] | None,
    base: Sequence[Tensor] | None,
    rule: MergeRule,
    alpha: float,
    kept: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """The learner's new fragment after a round (see the module docstring); new tensors,
    computed by ``merge_into`` on copies of ``local``. Raises as ``merge_into`` does."""
    result = [x.detach().clone() for x in local]
    merge_into(
        result,
        outcome,
        theta=theta,
        snapshot=snapshot,
        base=base,
        rule=rule,
        alpha=alpha,
        kept=kept,
    )
    return result


@dataclass(frozen=True, slots=True)
class Tally:
    """A number of local steps and the tokens they consumed."""

    steps: int = 0
    tokens: int = 0

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(self.steps + other.steps, self.tokens + other.tokens)

    def __sub__(self, other: "Tally") -> "Tally":
        return Tally(self.steps - other.steps, self.tokens - other.tokens)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A published snapshot awaiting its round: ``round`` and the steps it covers."""

    round: int
    covers: Tally


@dataclass(frozen=True, slots=True)
class FragmentLedger:
    """One fragment's accounting: every local step so far (``total``), split into those
    rounds included (``committed``), those dropped, and those still local (``since_base``,
    which holds the ``in_flight`` snapshot's)."""

    fragment: int
    total: Tally = Tally()
    committed: Tally = Tally()
    dropped: Tally = Tally()
    since_base: Tally = Tally()
    in_flight: InFlight | None = None

    @property
    def balanced(self) -> bool:
        """The invariant ``committed + dropped + since_base == total``."""
        return self.committed + self.dropped + self.since_base == self.total


@dataclass(frozen=True, slots=True)
class Resolution:
    """What a record did with this learner's in-flight snapshot of ``fragment`` for
    ``round`` (committed as ``version``).

    ``steps`` and ``tokens`` are what moved: into ``committed`` when ``included``, into
    ``dropped`` when ``rejected`` (the snapshot's and the lag's: the merge resets the
    fragment to the round's θ), and back to the next snapshot when ``late`` (the snapshot's).
    ``lag`` is the number of local steps taken after the snapshot. ``reason`` is the
    rejection's, else None.
    """

    outcome: Outcome
    fragment: int
    round: int
    version: int
    steps: int
    tokens: int
    lag: int
    reason: RejectReason | None = None


@dataclass(frozen=True, slots=True)
class Dropped:
    """``steps`` and ``tokens`` of ``fragment`` that no round will carry, and why."""

    fragment: int
    steps: int
    tokens: int
    reason: DropReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Ledger:
    """A learner's step accounting, one ``FragmentLedger`` per fragment (see the module
    docstring). Every transition returns a new ledger and leaves this one as it was."""

    fragments: tuple[FragmentLedger, ...]

    @classmethod
    def new(cls, fragments: int) -> "Ledger":
        """The ledger of a learner that has taken no step, for ``fragments`` fragments."""
        if fragments < 1:
            raise ValueError(f"a run has at least one fragment, got {fragments}")
        return cls(tuple(FragmentLedger(fragment=f) for f in range(fragments)))

    @classmethod
    def start(cls, fragments: int) -> "Ledger":
        """Same as ``new``."""
        return cls.new(fragments)

    def __getitem__(self, fragment: int) -> FragmentLedger:
        return self.fragments[self._index(fragment)]

    def _index(self, fragment: int) -> int:
        if not 0 <= fragment < len(self.fragments):
            raise ValueError(f"fragment {fragment} is not in [0, {len(self.fragments)})")
        return fragment

    def _with(self, entry: FragmentLedger) -> "Ledger":
        fragments = list(self.fragments)
        fragments[entry.fragment] = entry
        return Ledger(tuple(fragments))

    def stepped(self, tokens: int) -> "Ledger":
        """One local step that consumed ``tokens`` (>= 0); it counts for every fragment."""
        if tokens < 0:
            raise ValueError(f"a step consumes a non-negative number of tokens, got {tokens}")
        step = Tally(1, tokens)
        return Ledger(
            tuple(
                replace(f, total=f.total + step, since_base=f.since_base + step)
                for f in self.fragments
            )
        )

    def published(self, fragment: int, round: int) -> "Ledger":
        """A snapshot of ``fragment`` for ``round`` went out; it covers every step since the
        base. Raises ``ValueError`` if one is already in flight or there is no step to cover.
        """
        entry = self[fragment]
        if entry.in_flight is not None:
            raise ValueError(
                f"fragment {fragment} already has a snapshot in flight for round "
                f"{entry.in_flight.round}; wait for its record or its failure"
            )
        if entry.since_base.steps < 1:
            raise ValueError(f"fragment {fragment} has no local step since its base to publish")
        return self._with(replace(entry, in_flight=InFlight(round, entry.since_base)))

    def publish_failed(self, fragment: int) -> "Ledger":
        """The in-flight snapshot of ``fragment`` never reached the store: it is forgotten
        and its steps go out with the next one. Raises ``ValueError`` if none is in flight."""
        entry = self[fragment]
        if entry.in_flight is None:
            raise ValueError(f"fragment {fragment} has no snapshot in flight")
        return self._with(replace(entry, in_flight=None))

    def recorded(self, record: RoundRecord, learner: str) -> tuple["Ledger", Resolution | None]:
        """Fold the committed ``record`` (every record of the run, in round order).

        Resolves this learner's in-flight snapshot of the record's fragment when the record
        is for its round (``included`` if a participant, ``rejected`` if rejected, ``late``
        if absent) or for a later round (``late``); anything else leaves the ledger as is
        and returns None.
        """
        entry = self[record.fragment]
        flight = entry.in_flight
        if flight is None or record.round < flight.round:
            return self, None
        lag = entry.since_base.steps - flight.covers.steps
        outcome: Outcome = "late"
        rejection = None
        if record.round == flight.round:
            if any(p.learner == learner for p in record.participants):
                outcome = "included"
            else:
                rejection = next((r for r in record.rejected if r.learner == learner), None)
                if rejection is not None:
                    outcome = "rejected"
        moved = flight.covers
        if outcome == "included":
            entry = replace(
                entry,
                committed=entry.committed + moved,
                since_base=entry.since_base - moved,
                in_flight=None,
            )
        elif outcome == "rejected":
            moved = entry.since_base
            entry = replace(
                entry, dropped=entry.dropped + moved, since_base=Tally(), in_flight=None
            )
        else:
            entry = replace(entry, in_flight=None)
        resolution = Resolution(
            outcome=outcome,
            fragment=record.fragment,
            round=flight.round,
            version=record.version,
            steps=moved.steps,
            tokens=moved.tokens,
            lag=lag,
            reason=None if rejection is None else rejection.reason,
        )
        return self._with(entry), resolution

    def dropped(
        self, fragment: int, reason: DropReason, detail: str = ""
    ) -> tuple["Ledger", Dropped]:
        """Give up the local steps of ``fragment`` (at close): ``since_base`` moves to
        ``dropped`` and an in-flight snapshot is forgotten."""
        entry = self[fragment]
        moved = entry.since_base
        entry = replace(entry, dropped=entry.dropped + moved, since_base=Tally(), in_flight=None)
        return self._with(entry), Dropped(fragment, moved.steps, moved.tokens, reason, detail)
