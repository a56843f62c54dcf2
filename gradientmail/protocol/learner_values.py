"""The values the pure learner (``protocol.learner``) is made of and answers with: its
actions, and the state of one fragment. Pure: no I/O."""

from dataclasses import dataclass
from typing import Literal, TypeAlias

from torch import Tensor

from gradientmail.protocol.merge import Dropped, Outcome, Resolution
from gradientmail.protocol.records import MergeRule, RoundRecord

__all__ = [
    "Action",
    "Apply",
    "Download",
    "Dropped",
    "Failure",
    "Publish",
    "Published",
    "Ready",
    "Recorded",
    "Resolved",
    "Slot",
    "Snapshot",
    "Stage",
    "Tensors",
    "Unavailable",
]

Tensors: TypeAlias = tuple[Tensor, ...]
Failure = Literal["gone", "corrupt"]
Stage = Literal["update", "theta"]


@dataclass(frozen=True, slots=True)
class Apply:
    """Merge ``theta`` (version ``version`` of ``fragment``, committed by ``round``) into the
    live weights: ``merge.merge_into(params, outcome, theta=…, snapshot=…, base=…, rule=…,
    alpha=…)``. ``lag`` is the number of local steps since the snapshot when it was
    included, else None; ``step`` the local step count."""

    fragment: int
    round: int
    version: int
    outcome: Outcome
    theta: Tensors
    snapshot: Tensors | None
    base: Tensors
    rule: MergeRule
    alpha: float
    step: int
    lag: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Copy ``fragment``'s live weights to the CPU and hand them to ``Learner.took``; the
    snapshot is for ``round``."""

    fragment: int
    round: int


@dataclass(frozen=True, slots=True)
class Publish:
    """Write ``snapshot − base`` of ``fragment`` for ``round`` (covering ``steps`` and
    ``tokens``), then report ``publish_done`` or ``publish_failed``. ``final``: a closing
    learner's last snapshot (``Learner.finalize``)."""

    fragment: int
    round: int
    base_version: int
    base: Tensors
    snapshot: Tensors
    steps: int
    tokens: int
    final: bool = False


@dataclass(frozen=True, slots=True)
class Download:
    """Fetch ``record``'s version of its fragment: ``base + update`` when ``base`` is not
    None (the next version), else θ rebuilt from the checkpoint at or below the record
    (``protocol.checkpoint``); then ``version_ready`` or ``download_failed``."""

    fragment: int
    record: RoundRecord
    base: Tensors | None


@dataclass(frozen=True, slots=True)
class Recorded:
    """``record`` was folded (report it)."""

    record: RoundRecord


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a round did with this learner's snapshot (the ``Ledger``'s resolution)."""

    resolution: Resolution


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Neither the update nor the θ of ``round`` (``fragment``) could be used: ``detail``.
    Reported once per record; the download is retried at every poll until it works or a
    newer record of the fragment replaces it."""

    fragment: int
    round: int
    detail: str


Action: TypeAlias = (
    Apply | Snapshot | Publish | Download | Recorded | Resolved | Dropped | Unavailable
)


@dataclass(frozen=True, slots=True)
class Published:
    """A snapshot of a fragment for ``round``, taken after local step ``step`` at time ``at``
    (``snapshot`` is None until the driver hands the copy over). ``outcome`` is set once
    the round's record is folded."""

    round: int
    step: int
    at: float
    snapshot: Tensors | None = None
    outcome: Outcome | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """Version ``version`` of a fragment, committed by ``round``: ``theta``."""

    round: int
    version: int
    theta: Tensors


@dataclass(frozen=True, slots=True)
class Slot:
    """One fragment as this learner holds it. ``wanted`` is the newest record of it not yet
    prepared; ``update_failed`` whether its update could not be used; ``reported`` whether
    it was reported ``Unavailable``."""

    version: int
    base: Tensors
    published: Published | None = None
    in_flight: bool = False
    ready: Ready | None = None
    wanted: RoundRecord | None = None
    update_failed: bool = False
    reported: bool = False

    @property
    def blocked(self) -> bool:
        """Whether a snapshot must wait: one is unresolved or a version is pending."""
        return (
            self.in_flight
            or self.published is not None
            or self.ready is not None
            or self.wanted is not None
        )
