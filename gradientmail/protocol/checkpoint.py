"""Checkpoints: which round records carry θ and the outer state, how any version is rebuilt
from the checkpoint below it, and what garbage collection keeps for that.

The record of version ``v`` of a fragment is a checkpoint (it names θ_v and, in a run whose
outer step keeps a state (``stateful``), the momentum m_v, both fp32) when ``v`` is a
multiple of ``checkpoint_every``; version 0 is Θ⁰, in the manifest, with no momentum yet.
Every record names its update, and the committed version is defined by it:
θ_{v+1} = θ_v + decode(U_{v+1}) (docs/protocol.md, "The update and the committed θ"). So
θ_v is θ_c of the checkpoint below it plus the updates c+1 … v applied in turn, bit for
bit, whatever the encoding (``replayed``): no round's update fails to reproduce its θ, and
no round other than the multiples needs a checkpoint.

The momentum evolves from the unquantized mean delta, which no update carries. It is
replayed from the deltas of the round's participants with the weights its record names,
through the functions the round itself ran (``aggregation.weighted_mean``, ``step``), so it
too is exact: the snapshots of the rounds after a fragment's checkpoint are kept until the
next one (``retained``). With ``outer_momentum`` 0 the outer step is a function of the
round's mean delta alone: there is no state to carry, checkpoints name θ only and no
snapshot is kept for a replay.

Pure: no I/O; runs on whatever thread calls it (the node uses worker threads). Importing it
does not import torch (a record's check serves readers that never touch a tensor); the
functions over tensors import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradientmail.errors import RecordError
from gradientmail.protocol import keys
from gradientmail.protocol.records import FragmentSpec, RoundRecord, RunConfig, Snapshot

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "Retained",
    "base",
    "check_record",
    "is_checkpoint",
    "mean_of",
    "replayed",
    "retained",
    "stateful",
    "step",
]


def stateful(config: RunConfig) -> bool:
    """Whether the outer step keeps a state from round to round (``outer_momentum`` > 0):
    only then do checkpoints carry it and do rebuilds replay it from the rounds' deltas."""
    return config.outer_momentum > 0


def is_checkpoint(version: int, config: RunConfig) -> bool:
    """Whether the record of ``version`` (≥ 1) must carry θ and the outer state."""
    return version >= 1 and version % config.checkpoint_interval == 0


def base(version: int, config: RunConfig) -> int:
    """The checkpoint at or below ``version`` that every record guarantees (0: Θ⁰)."""
    return version - version % config.checkpoint_interval


def check_record(record: RoundRecord, round: int, config: RunConfig) -> RoundRecord:
    """``record`` if it can be the record of ``round``; else ``RecordError`` naming what is
    wrong: another round, fragment or version than ``round`` produces, or a checkpoint
    version without its θ and outer-state blobs (a writer with another
    ``checkpoint_every`` than the manifest's, or a damaged record). In a ``stateful`` run
    a checkpoint names both; otherwise its θ (an outer-state blob there is ignored)."""
    if (
        record.round != round
        or record.fragment != keys.fragment_of(round, config.fragments)
        or record.version != keys.version_of(round, config.fragments)
    ):
        raise RecordError(
            f"records/{round:010d} names round {record.round}, fragment {record.fragment}, "
            f"version {record.version}: not what round {round} produces"
        )
    if is_checkpoint(record.version, config) and (
        not record.checkpoint or (stateful(config) and record.outer is None)
    ):
        raise RecordError(
            f"records/{round:010d}: version {record.version} of fragment {record.fragment} is "
            f"a checkpoint (the run's checkpoint_every is {config.checkpoint_interval}) but the "
            "record names no θ or no outer-state blob; it was written under another "
            "checkpoint_every than the manifest's, or damaged: the versions after it cannot "
            "be rebuilt from it"
        )
    return record


def step(
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    mean: Sequence[Tensor] | None,
    config: RunConfig,
    *,
    final: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    """``(θ', m)``: the raw θ' of a round and its momentum after it, from θ_v, the momentum
    before it (None: no step yet) and the round's ``mean`` delta (None: it accepted none,
    and θ' = θ_v with the momentum unchanged, zeros if there was none). A ``final`` round is
    ``outer.final_step``'s, any other ``outer.outer_step``'s."""
    import torch

    from gradientmail.protocol.outer import final_step, outer_step

    if mean is None:
        kept = list(momentum) if momentum is not None else [torch.zeros_like(t) for t in theta]
        return list(theta), kept
    if final:
        return final_step(theta, momentum, mean)
    return outer_step(
        theta, momentum, mean, lr=config.outer_lr, momentum_coef=config.outer_momentum
    )


def mean_of(
    record: RoundRecord,
    snapshots: Sequence[tuple[Snapshot, Sequence[Tensor]]],
    spec: FragmentSpec,
    config: RunConfig,
) -> tuple[list[Tensor] | None, bool]:
    """The mean delta of ``record``'s round again, and whether the round was final, from the
    decoded deltas of its participants' ``snapshots`` (any order; others are ignored).
    Raises ``RecordError`` naming a participant whose snapshot is missing."""
    from gradientmail.protocol.mean import by_senders, weighted_mean

    by_learner = {snapshot.learner: (snapshot, delta) for snapshot, delta in snapshots}
    chosen = []
    for participant in record.participants:
        found = by_learner.get(participant.learner)
        if found is None:
            raise RecordError(
                f"round {record.round} counts {participant.learner!r}, whose snapshot is gone: "
                "its momentum cannot be replayed"
            )
        chosen.append(found)
    if not chosen:
        return None, False
    final = all(snapshot.final is True for snapshot, _ in chosen)
    weights = [p.weight for p in record.participants]
    sparse = [by_senders(snapshot, config) for snapshot, _ in chosen]
    return weighted_mean([delta for _, delta in chosen], weights, spec, sparse), final


def replayed(
    theta: Sequence[Tensor],
    momentum: Sequence[Tensor] | None,
    update: bytes,
    spec: FragmentSpec,
    config: RunConfig,
    *,
    mean: tuple[Sequence[Tensor] | None, bool] | None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """θ_{v+1} and the momentum after the round, from θ_v, the momentum before it, the
    round's ``update`` blob and ``mean`` (``mean_of``'s answer; None: the momentum is not
    wanted, and None comes back). Raises ``CodecError`` for a malformed update and
    ``ValueError`` for one of another shape."""
    from gradientmail.protocol.outer import apply_update

    theta_next = apply_update(theta, update, spec)
    if mean is None:
        return theta_next, None
    _, momentum_next = step(theta, momentum, mean[0], config, final=mean[1])
    return theta_next, momentum_next


@dataclass(frozen=True, slots=True)
class Retained:
    """What garbage collection keeps after a round is committed, among the rounds up to it:
    the rounds whose records' blobs stay (``records``), and those whose snapshots (and the
    deltas they name) and claims stay (``snapshots``). Rounds after it are always kept."""

    records: frozenset[int]
    snapshots: frozenset[int]


def retained(round: int, config: RunConfig) -> Retained:
    """``Retained`` after committing ``round`` (-1: none committed yet): for every fragment,
    the newest ``keep_versions`` versions and what rebuilds each of them with its momentum:
    the checkpoint at or below the oldest (its record's blobs), every record after it (their
    updates) and, in a ``stateful`` run, the snapshots of their rounds but checkpoints' (the
    momentum's replay starts there); and the snapshots of the newest ``keep_rounds`` rounds."""
    count = config.fragments
    records: set[int] = set()
    snapshots = set(range(max(round - config.keep_rounds + 1, 0), round + 1))
    for fragment in range(min(count, round + 1)):
        newest = (round - fragment) // count + 1
        oldest = max(newest - config.keep_versions + 1, 0)
        start = base(oldest, config)
        for version in range(max(start, 1), newest + 1):
            records.add(keys.round_of(fragment, version, count))
        replays = range(start + 1, newest + 1) if stateful(config) else range(0)
        for version in replays:
            if not is_checkpoint(version, config):
                snapshots.add(keys.round_of(fragment, version, count))
    return Retained(frozenset(records), frozenset(snapshots))
