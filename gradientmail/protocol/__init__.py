"""The pure core of gradientmail: the run's layout in the store and the numerics of a round.

No module of this package imports anyio, the mailbox or an event loop, and none does I/O or
reads a clock; the node moves bytes and time around them (``docs/protocol.md``).

``keys``
    Where every object of a run lives in its mailbox, and round numbering.
``config``
    The run-wide settings (``RunConfig``) and the names of the choices they make.
``records``
    The objects in the store (manifest, claims, snapshots, round records) as msgspec structs.
``codec``
    Blob addresses and the tensor codec (safetensors; fp32, bf16, int8, int4).
``fragments``
    The model's split into fragments, signature mismatches, and the schedule.
``aggregation``
    A round's rejections, weights and weighted mean delta.
``bounds``
    One learner's bounded influence on a round: capped weights, clipped deltas.
``outer``
    The outer Nesterov step and the update learners apply.
``merge``
    The learner's merge of a new version, and its step accounting (``Ledger``).

The record and config types are re-exported here; the functions live in their modules.
"""

from gradientmail.protocol.config import Encoding, MergeRule, Pattern, RunConfig, Weighting
from gradientmail.protocol.records import (
    FORMAT_VERSION,
    BlobRef,
    CreateClaim,
    FragmentSpec,
    InitMarker,
    LeaseBeat,
    Manifest,
    ParamSpec,
    Participant,
    Rejection,
    RejectReason,
    RoundClaim,
    RoundRecord,
    RoundRecordDraft,
    Snapshot,
)

__all__ = [
    "FORMAT_VERSION",
    "BlobRef",
    "CreateClaim",
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
    "Snapshot",
    "Weighting",
]
