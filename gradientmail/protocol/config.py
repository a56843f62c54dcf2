"""The run-wide settings (``RunConfig``), fixed at creation and stored in the manifest, and
the names of the choices they make (encodings, fragment patterns, weightings, merge rules).

Pure: no I/O.
"""

import math
from typing import Any, Literal

import msgspec

__all__ = [
    "CHECKPOINT_EVERY",
    "TOPK_CHECKPOINT_EVERY",
    "Encoding",
    "MergeRule",
    "Pattern",
    "RunConfig",
    "Weighting",
]

CHECKPOINT_EVERY = 2
"""Versions between checkpoints by default (docs/protocol.md, "Recommended settings")."""
TOPK_CHECKPOINT_EVERY = 16
"""Versions between checkpoints by default when updates are ``topk`` (docs/protocol.md,
"Recommended settings": a θ is hundreds of ``topk`` updates)."""

Encoding = Literal["fp32", "bf16", "int8", "int4", "topk"]
"""How a delta or an update travels: full fp32, bf16, blockwise-absmax int8 / int4, or
chunked Top-k with low-bit values (``protocol.sparse``)."""
Pattern = Literal["contiguous", "strided", "balanced", "even"]
"""How parameters are split into fragments (see ``protocol.fragments``)."""
Weighting = Literal["tokens", "steps", "equal"]
"""What a snapshot's weight in its round is proportional to."""
MergeRule = Literal["keep-progress", "alpha"]
"""How a learner merges a new version with its local progress (see ``protocol.merge``)."""


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The run-wide settings, fixed at creation and stored in the manifest.

    A node joining a run with a config passes it to check it (``RunMismatch`` names the first
    field that differs); a node that passes none takes the manifest's.

    The few a run sets first; every other field has a measured default
    (docs/protocol.md, "Recommended settings"):

    - ``sync_every`` and ``fragments``: how many local steps between a fragment's rounds,
      and how many fragments share them (fewer bytes at once, more rounds);
    - ``delta_encoding`` and ``update_encoding``: the bytes each round moves (``int8``;
      ``RunConfig.sparse()`` for the fewest, ``topk`` with the outer step it needs);
    - ``overlap``: None for fleets of unequal machines, ``RunConfig.repeatable()`` for
      the same model from the same batches;
    - ``robust``: for fleets whose key holders are not all trusted.

    Then, by concern: the outer step (``outer_lr``, ``outer_momentum``), the rounds
    (``quorum_min``, ``quorum_fraction``, ``grace``), what a round rejects and how it
    weighs (``weighting``, ``max_staleness``, ``outlier_factor``,
    ``max_tokens_per_step``), the encodings' details (``block_size``, ``topk_*``), the
    merge (``merge``, ``alpha``) and the store (``checkpoint_every``, ``keep_*``).

    fragments, sync_every, pattern
        The model is split into ``fragments`` groups of parameters (``pattern``; the default,
        ``even``, balances them by size and splits a large tensor by rows); each is
        synchronized every ``sync_every`` local steps, staggered (``protocol.fragments``).
    delta_encoding, update_encoding, block_size
        How learners' deltas and the syncer's updates travel; ``block_size`` elements share one
        scale under int8 / int4.
    topk_density, topk_bits, topk_chunk, topk_feedback
        The ``topk`` encoding (``protocol.sparse``): a delta sends the ``topk_density``
        largest of every ``topk_chunk`` elements at ``topk_bits`` bits (1, 2, 4 or 8) and
        the share ``topk_feedback`` of the rest stays in the learner's weights for its next
        delta (error feedback and its decay, ``protocol.feedback``); an update sends every
        non-zero element at 4 bits but those under 1/30 of their chunk's largest. The
        committed θ lags the learners' weights by what they have not sent until the run's
        close, whose final snapshots and updates are dense (``sparse.sent_as``).
    outer_lr, outer_momentum
        Nesterov momentum SGD on the averaged pseudo-gradient (DiLoCo's paper: 0.7 and 0.9;
        the defaults, 1.0 and 0.6, are the best measured: docs/protocol.md, "Recommended
        settings").
    weighting, max_staleness, outlier_factor, max_tokens_per_step
        How a round weighs snapshots and which it rejects: based more than ``max_staleness``
        versions behind, a norm over ``outlier_factor`` times the median of the round's
        norms brought to its steps (3+ snapshots; ``protocol.aggregation``), or more than
        ``max_tokens_per_step`` tokens per claimed step.
    robust
        Bound each snapshot's weight (``protocol.bounds``) and its delta's share of the
        mean (``protocol.robust``: centered clipping among three or more, clipped norms
        among two); for fleets with untrusted key holders. Off by default (its cost on
        an honest run: docs/protocol.md, "Aggregation").
    quorum_min, quorum_fraction, grace
        A round closes once it has at least ``quorum_min`` snapshots and at least
        ``quorum_fraction`` of the live learners, then waits up to ``grace`` seconds more for
        the rest.
    merge, alpha
        ``keep-progress``: a learner keeps its progress since its snapshot on top of the new
        version; ``alpha``: θ ← alpha·θ_local + (1 − alpha)·θ_global.
    overlap
        The schedule. None (the default, for fleets of unequal or pausing machines: the
        adaptive schedule): each learner applies a round's version at its first step after
        the version is ready, never waiting; a slower learner takes fewer local steps per
        round (``protocol.pace``) so that a round's snapshots arrive together, and a round
        waits only for the learners that took part in the round before, each for a bounded
        time (``rounds.expectation``). A number of steps (the repeatable mode,
        ``RunConfig.repeatable``): every learner takes ``sync_every`` steps per period and
        applies the version of a round it published to exactly ``overlap`` local steps after
        its snapshot (at most ``sync_every``; ``applied_after``), its ``step`` waiting for
        the version when it is not ready by then (at most ``rounds.due_for``, twice the
        grace, after the snapshot), and the rounds wait for every live learner: the same run
        on the same batches gives the same model, and every learner runs at the pace of the
        slowest (docs/protocol.md, "Rounds that pace the learners"). ``overlap`` 0 is the
        synchronous mode: the step that snapshots waits for its round's version and applies
        it before the next step, as torchft's DiLoCo does at each fragment sync (no local
        step is taken on a stale version, and each round's latency is waited out).
    checkpoint_every
        θ and the outer momentum of a fragment are stored (a checkpoint) with every
        ``checkpoint_every``-th version of it (None, the default: ``CHECKPOINT_EVERY``, or
        ``TOPK_CHECKPOINT_EVERY`` when updates are ``topk``, whose θ outweighs many of its
        rounds; ``checkpoint_interval`` gives the number); every other record carries only
        its update, from which the versions after a checkpoint are replayed exactly
        (``protocol.checkpoint``), with the momentum from the deltas of their rounds. With
        ``outer_momentum`` 0 the outer step keeps no state: a checkpoint is θ alone, and no
        delta is kept for a replay.
    keep_rounds, keep_versions
        Garbage collection: snapshots and claims of rounds older than ``keep_rounds`` rounds
        are deleted unless replaying the newest version needs them, and a record's blobs once
        neither the newest ``keep_versions`` versions of its fragment nor their replay from
        the checkpoint below them name them (``protocol.checkpoint.retained``).

        The store's peak, with ``keep_versions`` and ``keep_rounds`` 1: Θ⁰; each fragment's
        checkpoint (θ and momentum), its last ``C = checkpoint_every`` updates and the ``K``
        learners' deltas of its last ``C − 1`` rounds; and while a round closes, its new
        checkpoint and update and the deltas of it and of the rounds ahead that collection
        spares (``F − 1``; learners running ahead, or leaving, publish there; each further
        round they run on to when their waits for a slow closer end adds ``K·d·S / F``,
        and collection spares it too). For a model
        of ``S`` fp32 bytes in ``F`` equal fragments, updates ``u·S`` and deltas ``d·S``
        bytes in all (1 for fp32, about ¼ for int8): ``(3 + C·u + C·K·d + (2 + u) / F)·S``,
        plus about 1 kB of record per round. The defaults give 13.75·S for fp32 at
        ``K = F = 4`` and 6.1·S for int8; no retention gets below ``(3 + u + K·d / F)·S``
        (Θ⁰, a checkpoint, the newest updates and the deltas in flight). Checkpoints cost the
        syncers ``2·S / C`` of upload per ``F`` rounds (docs/protocol.md, "Garbage
        collection", has the measured trade). With ``outer_momentum`` 0 a checkpoint is θ
        alone and no delta waits for a replay: ``(2 + C·u + (1 + u + (F + 1)·K·d) / F)·S``
        (9.5·S for fp32 at ``K = F = 4``), and checkpoints cost ``S / C``.
    """

    fragments: int = 4
    sync_every: int = 50
    pattern: Pattern = "even"
    delta_encoding: Encoding = "fp32"
    update_encoding: Encoding = "fp32"
    block_size: int = 256
    topk_density: float = 0.01
    topk_bits: int = 2
    topk_chunk: int = 4096
    topk_feedback: float = 0.9
    outer_lr: float = 1.0
    outer_momentum: float = 0.6
    weighting: Weighting = "tokens"
    max_staleness: int = 1
    outlier_factor: float = 5.0
    max_tokens_per_step: int = 1 << 24
    robust: bool = False
    quorum_min: int = 1
    quorum_fraction: float = 1.0
    grace: float = 2.0
    merge: MergeRule = "keep-progress"
    alpha: float = 0.5
    overlap: int | None = None
    keep_rounds: int = 1
    keep_versions: int = 1
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        positive_ints = {
            "fragments": self.fragments,
            "sync_every": self.sync_every,
            "block_size": self.block_size,
            "quorum_min": self.quorum_min,
            "keep_rounds": self.keep_rounds,
            "keep_versions": self.keep_versions,
            "checkpoint_every": self.checkpoint_interval,
            "max_tokens_per_step": self.max_tokens_per_step,
        }
        for name, value in positive_ints.items():
            if value < 1:
                raise ValueError(f"RunConfig.{name} must be a positive integer, got {value!r}")
        if self.fragments > 9999:
            raise ValueError(f"RunConfig.fragments must be at most 9999, got {self.fragments}")
        if self.sync_every < self.fragments:
            raise ValueError(
                f"RunConfig.sync_every ({self.sync_every}) must be at least fragments "
                f"({self.fragments}) so that every fragment has its own offset"
            )
        if not isinstance(self.robust, bool):
            raise ValueError(f"RunConfig.robust must be True or False, got {self.robust!r}")
        if self.max_staleness < 0:
            raise ValueError(f"RunConfig.max_staleness must be >= 0, got {self.max_staleness}")
        ranges = {
            "outer_lr": (self.outer_lr, 0.0, math.inf),
            "outer_momentum": (self.outer_momentum, 0.0, 1.0),
            "outlier_factor": (self.outlier_factor, 1.0, math.inf),
            "quorum_fraction": (self.quorum_fraction, 0.0, 1.0),
            "grace": (self.grace, 0.0, math.inf),
            "alpha": (self.alpha, 0.0, 1.0),
            "topk_feedback": (self.topk_feedback, 0.0, 1.0),
        }
        for field, (number, low, high) in ranges.items():
            if not math.isfinite(number) or not low <= number <= high:
                raise ValueError(
                    f"RunConfig.{field} must be finite and in [{low}, {high}], got {number!r}"
                )
        if not 0 < self.topk_density <= 1 or self.topk_bits not in (1, 2, 4, 8):
            raise ValueError(
                f"RunConfig.topk_density must be in (0, 1] and topk_bits 1, 2, 4 or 8, got "
                f"{self.topk_density!r} and {self.topk_bits!r}"
            )
        if not 1 <= self.topk_chunk <= 1 << 16:
            raise ValueError(f"RunConfig.topk_chunk must be in [1, 65536], got {self.topk_chunk}")
        if self.outer_lr <= 0:
            raise ValueError(f"RunConfig.outer_lr must be positive, got {self.outer_lr}")
        if self.overlap is not None and self.overlap < 0:
            raise ValueError(
                f"RunConfig.overlap must be None (never wait) or a number of steps, 0 or "
                f"more, got {self.overlap}"
            )

    @classmethod
    def repeatable(cls, overlap: int = 2, **fields: Any) -> "RunConfig":
        """The repeatable mode: ``RunConfig(overlap=overlap, **fields)`` (see ``overlap``):
        for fleets of equal machines and for research that must rerun a run exactly."""
        return cls(overlap=overlap, **fields)

    @classmethod
    def sparse(cls, **fields: Any) -> "RunConfig":
        """Sparse compression: ``topk`` deltas and updates (at ``topk_density``) with the
        outer step they are measured with, ``outer_lr`` 1 and no momentum, so that an update
        holds the union of the learners' selections (a momentum makes it dense, larger than
        ``int8``; docs/protocol.md, "The outer step for ``topk``"). ``fields`` set any other
        field, these included."""
        chosen: dict[str, Any] = {
            "delta_encoding": "topk",
            "update_encoding": "topk",
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
        }
        return cls(**(chosen | fields))

    @property
    def checkpoint_interval(self) -> int:
        """The versions from one checkpoint to the next: ``checkpoint_every``, or its default
        for the update encoding."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return TOPK_CHECKPOINT_EVERY if self.update_encoding == "topk" else CHECKPOINT_EVERY

    def resolved(self) -> "RunConfig":
        """This config with ``checkpoint_every`` set to the interval it gives: what a run
        under it does, field by field (for comparing configs and showing one)."""
        return msgspec.structs.replace(self, checkpoint_every=self.checkpoint_interval)

    @property
    def applied_after(self) -> int | None:
        """The local steps from a snapshot to the step that applies its round's version:
        ``overlap``, at most ``sync_every`` (the fragment's next snapshot applies it at the
        latest); None without ``overlap``."""
        return None if self.overlap is None else min(self.overlap, self.sync_every)
