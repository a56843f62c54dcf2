"""The objects of a run in the store, as frozen msgspec structs encoded as JSON.

Every object carries ``format`` (``FORMAT_VERSION``), and in a signed run a ``signature``
(``protocol.signing``; absent from the encoding otherwise). Decoding is strict about types and
sizes: an object over its size limit, not JSON, of the wrong shape or of a format version
this code does not know raises ``RecordError`` naming what was wrong. Unknown extra fields
are ignored, so a newer writer can add optional fields without breaking older readers.

The record of a round (``RoundRecord``) is the commit point: it is written last, after the
blobs it references, and it is never rewritten; it binds the record before it
(``protocol.chain``).

Pure: no I/O.
"""

import math
from typing import Annotated, Any, Final, Literal, TypeAlias, TypeVar

import msgspec

from gradientmail.errors import RecordError

__all__ = [
    "DECODE_FAILURES",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_PARTS",
    "MAX_RECORD_BYTES",
    "BlobRef",
    "Count",
    "CreateClaim",
    "DropReason",
    "Encoding",
    "FragmentSpec",
    "InitMarker",
    "LeaseBeat",
    "Manifest",
    "MergeRule",
    "ParamSpec",
    "Participant",
    "Pattern",
    "RejectReason",
    "Rejection",
    "RoundClaim",
    "RoundRecord",
    "RoundRecordDraft",
    "RunConfig",
    "Sha256",
    "Snapshot",
    "SnapshotPart",
    "Weighting",
    "decode",
    "decode_failure",
    "encode",
]

FORMAT_VERSION: Final = 1
MAX_RECORD_BYTES: Final = 1 << 20
"""The largest claim, snapshot, marker or round record a reader accepts."""
MAX_MANIFEST_BYTES: Final = 16 << 20
"""The largest manifest a reader accepts (it lists every parameter of the model)."""

Encoding = Literal["fp32", "bf16", "int8", "int4", "topk"]
"""How a delta or an update travels: full fp32, bf16, blockwise-absmax int8 / int4, or
chunked Top-k with low-bit values (``protocol.sparse``)."""
Pattern = Literal["contiguous", "strided", "balanced", "even"]
"""How parameters are split into fragments (see ``protocol.fragments``)."""
Weighting = Literal["tokens", "steps", "equal"]
"""What a snapshot's weight in its round is proportional to."""
MergeRule = Literal["keep-progress", "alpha"]
"""How a learner merges a new version with its local progress (see ``protocol.merge``)."""
RejectReason = Literal[
    "corrupt",
    "shape",
    "non-finite",
    "stale",
    "outlier",
    "tokens",
    "unsigned",
    "bad-signature",
    "not-admitted",
    "revoked",
]
"""Why a round rejected a snapshot; each is explained in ``docs/protocol.md``."""
DropReason = Literal["rejected", "reset", "closed-without-flush", "gave-up"]
"""Why a learner's local steps will never reach a round (``events.StepsDropped``)."""


Count: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
"""A round, fragment, version, size or dimension: decoding rejects a negative one."""
Seconds: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
"""A duration a record states: decoding rejects a negative or absurd one (and infinity)."""
Share: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
"""A share of a learner's time: decoding rejects one outside [0, 1]."""
Sha256: TypeAlias = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
"""A blob's address: 64 lowercase hex digits."""


class _Object(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    format: int = FORMAT_VERSION
    signature: str | msgspec.UnsetType = msgspec.UNSET
    """In a signed run, the HMAC-SHA256 of the object (``protocol.signing``); absent (and
    not encoded) otherwise."""


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The run-wide settings, fixed at creation and stored in the manifest.

    A node joining a run with a config passes it to check it (``RunMismatch`` names the first
    field that differs); a node that passes none takes the manifest's.

    fragments, sync_every, pattern
        The model is split into ``fragments`` groups of parameters (``pattern``; the default,
        ``even``, balances them by size and splits a large tensor by rows); each is
        synchronized every ``sync_every`` local steps, staggered (``protocol.fragments``).
    delta_encoding, update_encoding, block_size
        How learners' deltas and the syncer's updates travel; ``block_size`` elements share one
        scale under int8 / int4.
    topk_density, topk_bits, topk_chunk
        The ``topk`` encoding (``protocol.sparse``): a delta sends the ``topk_density``
        largest of every ``topk_chunk`` elements at ``topk_bits`` bits (1, 2, 4 or 8) and
        keeps the rest in the learner's error feedback (``protocol.feedback``); an update
        sends every non-zero element at 8 bits.
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
        Bound each snapshot's weight and clip its delta against the round
        (``protocol.bounds``); for fleets with untrusted key holders. Off by default: it
        changes honest rounds too (clips about half of honest deltas) and its cost to an
        honest run is not measured yet.
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
        slowest (docs/protocol.md, "Rounds that pace the learners").
    checkpoint_every
        θ and the outer momentum of a fragment are stored (a checkpoint) with every
        ``checkpoint_every``-th version of it; every other record carries only its update,
        from which the versions after a checkpoint are replayed exactly
        (``protocol.checkpoint``).
    keep_rounds, keep_versions
        Garbage collection: snapshots and claims of rounds older than ``keep_rounds`` rounds
        are deleted unless replaying the newest version needs them, and a record's blobs once
        neither the newest ``keep_versions`` versions of its fragment nor their replay from
        the checkpoint below them name them (``protocol.checkpoint.retained``).
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
    keep_rounds: int = 16
    keep_versions: int = 2
    checkpoint_every: int = 8

    def __post_init__(self) -> None:
        positive_ints = {
            "fragments": self.fragments,
            "sync_every": self.sync_every,
            "block_size": self.block_size,
            "quorum_min": self.quorum_min,
            "keep_rounds": self.keep_rounds,
            "keep_versions": self.keep_versions,
            "checkpoint_every": self.checkpoint_every,
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
        if self.overlap is not None and self.overlap < 1:
            raise ValueError(
                f"RunConfig.overlap must be None (never wait) or a positive number of steps, "
                f"got {self.overlap}"
            )

    @classmethod
    def repeatable(cls, overlap: int = 2, **fields: Any) -> "RunConfig":
        """The repeatable mode: ``RunConfig(overlap=overlap, **fields)`` (see ``overlap``):
        for fleets of equal machines and for research that must rerun a run exactly."""
        return cls(overlap=overlap, **fields)

    @property
    def applied_after(self) -> int | None:
        """The local steps from a snapshot to the step that applies its round's version:
        ``overlap``, at most ``sync_every`` (the fragment's next snapshot applies it at the
        latest); None without ``overlap``."""
        return None if self.overlap is None else min(self.overlap, self.sync_every)


class BlobRef(msgspec.Struct, frozen=True, kw_only=True):
    """A content-addressed payload: ``blobs/{sha256}``, ``size`` bytes, in ``encoding``.

    ``index`` (θ and update blobs, which ranks of a sharded learner read in ranges) names
    the blob ``blobs/{index}`` holding the sha256 of every ``codec.INDEX_CHUNK`` bytes of
    this one, 32 raw bytes each, in order (``codec.chunk_index``): a range is checked chunk
    by chunk, since the address covers the whole blob. Absent (not encoded) otherwise."""

    sha256: Sha256
    size: Count
    encoding: str
    index: Sha256 | msgspec.UnsetType = msgspec.UNSET


class ParamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One parameter of the model: its qualified name, shape and dtype (``"float32"``), or,
    with ``start``, the rows ``[start, start + shape[0])`` of its first dimension (the
    ``even`` pattern splits a large parameter by rows between neighbouring fragments;
    ``shape`` is then the slice's)."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    shape: tuple[Count, ...]
    dtype: str
    start: Count | msgspec.UnsetType = msgspec.UNSET

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FragmentSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The parameters of fragment ``index``, in the order they are serialized."""

    index: Count
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        return sum(param.numel for param in self.params)


class Manifest(_Object, frozen=True, kw_only=True):
    """The run's identity, create-once at ``manifest``: who created it, with what config,
    the model's signature (one ``FragmentSpec`` per fragment), each fragment's Θ⁰, its
    random ``run_id``, and in a signed run the id of its key."""

    created_by: str
    config: RunConfig
    fragments: tuple[FragmentSpec, ...]
    theta0: tuple[BlobRef, ...]
    key_id: str | msgspec.UnsetType = msgspec.UNSET
    """In a signed run, the id of its run key (``protocol.signing.RunKey.key_id``), which
    reveals nothing of the key; absent in an unsigned run."""
    run_id: str | msgspec.UnsetType = msgspec.UNSET
    """32 random hex digits drawn when the run is created (``Store.create_manifest``): every
    signature of a signed run covers it, so nothing replays across runs; absent in runs
    created before it existed."""
    learners: dict[str, str] | msgspec.UnsetType = msgspec.UNSET
    """In a run with learner identities, the public key of each learner listed at creation
    (``protocol.identities``); absent otherwise."""


class CreateClaim(_Object, frozen=True, kw_only=True):
    """A claim to create the run, at ``create/{attempt}``."""

    learner: str


class InitMarker(_Object, frozen=True, kw_only=True):
    """Θ⁰ of ``fragment`` is uploaded as ``blob`` by the attempt the key names."""

    learner: str
    fragment: Count
    blob: BlobRef


class LeaseBeat(_Object, frozen=True, kw_only=True):
    """One beat of ``learner``'s lease."""

    learner: str


MAX_PARTS: Final = 1024
"""The most parts a snapshot's delta may come in (``SnapshotPart``): a learner group's ranks,
with room to spare; a syncer fetches every part, so the bound caps a forged snapshot's cost."""


class SnapshotPart(msgspec.Struct, frozen=True, kw_only=True):
    """One blob of a snapshot's delta uploaded in parts: the rows ``rows[i] = (start, end)``
    of parameter ``i`` of the fragment (rows of the first dimension; a 0-dimensional parameter
    has one row), encoded as a fragment of those rows (``codec.part_spec``). A learner group
    whose ranks hold shards of the parameters (FSDP2) uploads one part per rank."""

    delta: BlobRef
    rows: tuple[tuple[Count, Count], ...]


class Snapshot(_Object, frozen=True, kw_only=True):
    """``learner``'s delta of ``fragment`` for ``round``: ``steps`` local steps and ``tokens``
    tokens since it was based on ``base_version``. ``norm`` is the writer's claim of the
    delta's L2 norm (None if not finite); readers recompute it from the blob. ``steps`` and
    ``tokens`` are not range-checked when decoding: a round rejects implausible ones with the
    reason ``tokens``, which names the learner.

    The delta is one blob (``delta``) or, from a learner group of sharded ranks, ``parts``
    that together hold every row of every parameter once, in order (``codec.check_parts``);
    exactly one of the two is set, so a whole snapshot encodes as it did before parts existed.

    ``closing`` True marks a snapshot taken after its learner began closing (its flush, and
    its final snapshot): learners closing together judge by it whether the others trained
    on. ``final`` True marks a closing learner's last snapshot: its delta is the model it
    held when it began closing minus θ of ``base_version``, with 0 steps and tokens; a round
    made only of final snapshots averages them without an outer step (docs/protocol.md,
    "The last round of a run"). Both are absent (not encoded) when false, so records written
    before the fields existed read and verify as they did.

    ``step_time`` (the learner's median step duration, seconds) and ``waited`` (the share of
    its time it spent waiting on rounds lately) are its pace, which the round copies into
    its ``Participant`` for the other learners' schedules and for ``status``; absent when
    unknown."""

    learner: str
    round: Count
    fragment: Count
    base_version: Count
    steps: int
    tokens: int
    delta: BlobRef | msgspec.UnsetType = msgspec.UNSET
    norm: float | None
    closing: bool | msgspec.UnsetType = msgspec.UNSET
    final: bool | msgspec.UnsetType = msgspec.UNSET
    parts: tuple[SnapshotPart, ...] | msgspec.UnsetType = msgspec.UNSET
    step_time: Seconds | msgspec.UnsetType = msgspec.UNSET
    waited: Share | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        whole = isinstance(self.delta, BlobRef)
        if whole == isinstance(self.parts, tuple):
            raise ValueError("a snapshot names its delta as one blob or in parts, exactly one")
        if isinstance(self.parts, tuple) and not 1 <= len(self.parts) <= MAX_PARTS:
            raise ValueError(f"a snapshot's delta comes in 1 to {MAX_PARTS} parts")

    @property
    def blobs(self) -> tuple[BlobRef, ...]:
        """The blobs of the delta: the one, or each part's in order."""
        if isinstance(self.delta, BlobRef):
            return (self.delta,)
        assert isinstance(self.parts, tuple)
        return tuple(part.delta for part in self.parts)


class RoundClaim(_Object, frozen=True, kw_only=True):
    """The k-th claim to close a round; the key names the round and k."""

    learner: str


class Participant(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot accepted into a round with its normalized ``weight``; ``closing`` as the
    snapshot's (absent when false); ``arrived``: how many seconds after the round's first
    snapshot the closer first listed this one (its clock, to its poll; absent from records
    of writers that did not note it); ``step_time`` and ``waited``: the snapshot's pace
    (absent when it stated none); ``bounded``: what capped its weight or clipped its delta
    (``protocol.bounds``; absent when nothing did), ``weight`` then being the coefficient of
    its delta in the mean, its normalized weight times its clip scale."""

    learner: str
    weight: float
    steps: int
    tokens: int
    base_version: int
    closing: bool | msgspec.UnsetType = msgspec.UNSET
    arrived: Seconds | msgspec.UnsetType = msgspec.UNSET
    step_time: Seconds | msgspec.UnsetType = msgspec.UNSET
    waited: Share | msgspec.UnsetType = msgspec.UNSET
    bounded: str | msgspec.UnsetType = msgspec.UNSET

    @property
    def pace(self) -> float | None:
        """The step time the snapshot stated, None when it stated none."""
        return None if isinstance(self.step_time, msgspec.UnsetType) else self.step_time


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot a round rejected, why, and the steps and tokens dropped with it."""

    learner: str
    reason: RejectReason
    steps: int
    tokens: int
    detail: str = ""


class RoundRecordDraft(_Object, frozen=True, kw_only=True):
    """A closed round before its blobs exist: who took part with what weight, who was
    rejected and why, how long the quorum and the grace period took (seconds on the closer's
    clock), and the mean cosine similarity of the accepted deltas to their mean (None for
    fewer than two)."""

    round: Count
    fragment: Count
    version: Count
    committed_by: str
    participants: tuple[Participant, ...]
    rejected: tuple[Rejection, ...] = ()
    quorum_seconds: float
    grace_seconds: float
    cosine: float | None
    closed_at: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)] | msgspec.UnsetType = msgspec.UNSET
    """When the closer drafted the record, in seconds since the Unix epoch on its wall clock:
    shown by ``status`` and ``report``, never read by a protocol decision (absent from
    records of writers that did not note it)."""


class RoundRecord(RoundRecordDraft, frozen=True, kw_only=True):
    """The commit point of a round, at ``records/{round}``: the draft plus the update
    U = θ_{v+1} − θ_v learners apply and, at a checkpoint (``protocol.checkpoint``), the
    new θ of the fragment and the outer optimizer's state, both or neither (null).
    ``previous`` binds the history (``protocol.chain``): the sha256 of the previous round's
    record as stored, or for round 0 of the manifest; absent from records written before it
    existed."""

    update: BlobRef
    theta: BlobRef | None = None
    outer: BlobRef | None = None
    previous: Sha256 | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if (self.theta is None) != (self.outer is None):
            raise ValueError(
                "a round record names its θ and outer-state blobs together (a checkpoint) "
                "or neither"
            )

    @property
    def checkpoint(self) -> bool:
        """Whether the record carries θ and the outer state."""
        return self.theta is not None

    @classmethod
    def committed(
        cls,
        draft: RoundRecordDraft,
        *,
        update: BlobRef,
        theta: BlobRef | None = None,
        outer: BlobRef | None = None,
    ) -> "RoundRecord":
        """The record of ``draft`` once its blobs are in the store (θ and ``outer`` only
        at a checkpoint)."""
        fields = {name: getattr(draft, name) for name in RoundRecordDraft.__struct_fields__}
        return cls(**fields, theta=theta, outer=outer, update=update)


T = TypeVar("T", bound=_Object)

_encoder = msgspec.json.Encoder(order="deterministic")


class _Header(msgspec.Struct, forbid_unknown_fields=False):
    format: Any = None


DECODE_FAILURES = (msgspec.DecodeError, ValueError, TypeError, RecursionError)
"""What msgspec raises for hostile bytes: malformed JSON or types (``DecodeError``), a
``__post_init__`` refusal (``ValueError``), and JSON nested deeper than the interpreter's
recursion limit (``RecursionError``, from ~2 KB of brackets)."""


def decode_failure(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deep to decode"
    return str(exc)


def encode(obj: _Object | RunConfig) -> bytes:
    """Canonical JSON bytes of ``obj``: keys in a fixed order, no whitespace."""
    return _encoder.encode(obj)


def decode(data: bytes, kind: type[T]) -> T:
    """Decode ``data`` as a ``kind``, strictly; raises ``RecordError`` saying what is wrong,
    and nothing else, whatever the bytes."""
    limit = MAX_MANIFEST_BYTES if kind is Manifest else MAX_RECORD_BYTES
    name = kind.__name__
    if len(data) > limit:
        raise RecordError(f"{name}: {len(data)} bytes is over the {limit}-byte limit")
    try:
        header = msgspec.json.decode(data, type=_Header)
    except DECODE_FAILURES as exc:
        raise RecordError(f"{name}: not a JSON object: {decode_failure(exc)}") from exc
    if header.format != FORMAT_VERSION:
        raise RecordError(
            f"{name}: format {header.format!r} is not one this gradientmail knows "
            f"({FORMAT_VERSION}); upgrade gradientmail to read this run"
        )
    try:
        return msgspec.json.decode(data, type=kind, strict=True)
    except DECODE_FAILURES as exc:
        raise RecordError(f"{name}: {decode_failure(exc)}") from exc
