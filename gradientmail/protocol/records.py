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

import hashlib
import math
from typing import Annotated, Any, Final, Literal, TypeAlias, TypeVar

import msgspec

from gradientmail.errors import RecordError
from gradientmail.protocol.config import Encoding, RunConfig

__all__ = [
    "DECODE_FAILURES",
    "FORMAT_VERSION",
    "INDEX_CHUNK",
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
    "ParamSpec",
    "Participant",
    "RejectReason",
    "Rejection",
    "RoundClaim",
    "RoundRecord",
    "RoundRecordDraft",
    "RunConfig",
    "Sha256",
    "Snapshot",
    "SnapshotPart",
    "chunk_index",
    "chunks_of",
    "decode",
    "decode_failure",
    "encode",
]

FORMAT_VERSION: Final = 1
MAX_RECORD_BYTES: Final = 1 << 20
"""The largest claim, snapshot, marker or round record a reader accepts."""
MAX_MANIFEST_BYTES: Final = 16 << 20
"""The largest manifest a reader accepts (it lists every parameter of the model)."""

RejectReason = Literal[
    "corrupt",
    "shape",
    "non-finite",
    "stale",
    "outlier",
    "tokens",
    "loss",
    "unsigned",
    "bad-signature",
    "not-admitted",
    "revoked",
]
"""Why a round rejected a snapshot; each is explained in ``docs/protocol.md``."""
DropReason = Literal["rejected", "reset", "closed-without-flush", "gave-up", "behind"]
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


class BlobRef(msgspec.Struct, frozen=True, kw_only=True):
    """A content-addressed payload: ``blobs/{sha256}``, ``size`` bytes, in ``encoding``.

    ``index`` (θ and update blobs, which ranks of a sharded learner read in ranges) names
    the blob ``blobs/{index}`` holding the sha256 of every ``INDEX_CHUNK`` bytes of
    this one, 32 raw bytes each, in order (``chunk_index``): a range is checked chunk
    by chunk, since the address covers the whole blob. Absent (not encoded) otherwise."""

    sha256: Sha256
    size: Count
    encoding: str
    index: Sha256 | msgspec.UnsetType = msgspec.UNSET


INDEX_CHUNK: Final = 1 << 16
"""The bytes each digest of a blob's index covers (``chunk_index``): a ranged read fetches
at most one chunk's worth more than it needs at each end of a range."""


def chunk_index(data: bytes) -> bytes:
    """The index of a blob: the raw sha256 of each ``INDEX_CHUNK`` bytes of ``data`` (the
    last chunk shorter), concatenated; empty for empty ``data``."""
    view = memoryview(data)
    return b"".join(
        hashlib.sha256(view[at : at + INDEX_CHUNK]).digest()
        for at in range(0, len(data), INDEX_CHUNK)
    )


def chunks_of(size: int) -> int:
    """The chunks of the index of a blob of ``size`` bytes."""
    return -(-size // INDEX_CHUNK)


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
    admission_key: str | msgspec.UnsetType = msgspec.UNSET
    """In a run with learner identities, the operator's admission public key (64 hex
    digits): admissions and revocations count only under it; absent otherwise."""


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
    has one row), encoded as a fragment of those rows (``layout.part_spec``). A learner group
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
    that together hold every row of every parameter once, in order (``layout.check_parts``);
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
    new θ of the fragment and, in a run whose outer step keeps a state (momentum), that
    state; never the state without θ.
    ``previous`` binds the history (``protocol.chain``): the sha256 of the previous round's
    record as stored, or for round 0 of the manifest; absent from records written before it
    existed."""

    update: BlobRef
    theta: BlobRef | None = None
    outer: BlobRef | None = None
    previous: Sha256 | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.theta is None and self.outer is not None:
            raise ValueError(
                "a round record names an outer-state blob only with its θ (a checkpoint)"
            )

    @property
    def checkpoint(self) -> bool:
        """Whether the record carries θ (and the outer state, in a run that keeps one)."""
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
        """The record of ``draft`` once its blobs are in the store (θ only at a checkpoint,
        ``outer`` only with θ)."""
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
