"""Tamper-evident history: each round record binds the bytes of the one before it.

A record's ``previous`` is the sha256 of the bytes of round ``round - 1``'s record as stored
(at whichever of its keys the committer took it from), and for round 0 the sha256 of the
manifest's bytes. Overwriting a committed record (a store without object lock or versioning)
then breaks the link from its successor, which every reader checks: ``link_problem`` says
which key no longer holds what the history was built on. A record overwritten with junk
before a successor binds it still shows: its round's next round is claimed
(``overwritten``). Records written before the field
existed carry none and are not checked against the record before them (a node that
commits over a record checks the link it writes: ``History.linked``).

Pure: no I/O.
"""

from dataclasses import dataclass

import msgspec

from gradientmail.protocol import keys
from gradientmail.protocol.records import RoundRecord

__all__ = ["Stored", "Tampering", "link_problem", "overwritten"]


@dataclass(frozen=True, slots=True)
class Stored:
    """A round record as a reader took it: the ``key`` it was read from (or written to) and
    the sha256 of the bytes there."""

    key: str
    digest: str
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class Tampering:
    """The history broke at ``key``: it no longer holds what the records after it were
    committed on (``why`` says how)."""

    key: str
    why: str


def link_problem(taken: Stored, before: Stored | None, manifest: str | None) -> Tampering | None:
    """Why ``taken`` does not chain onto ``before``, the record this reader took for the round
    before (None: that round holds no record that decodes), or for round 0 onto the manifest
    whose bytes hash to ``manifest`` (None: not read); None when it chains."""
    record, previous = taken.record, taken.record.previous
    if record.round == 0:
        if isinstance(previous, msgspec.UnsetType) or manifest in (None, previous):
            return None
        return Tampering(taken.key, f"{taken.key} does not bind the run's manifest")
    if before is None:
        key = keys.record(record.round - 1)
        return Tampering(
            key,
            f"{key} holds no record that decodes, yet {taken.key} was committed after it: "
            "the record there was overwritten",
        )
    if isinstance(previous, msgspec.UnsetType):
        return None
    if previous != before.digest:
        return Tampering(
            before.key,
            f"{before.key} is not the record {taken.key} was committed on: it was "
            "overwritten (or the record after it was)",
        )
    return None


def overwritten(
    round: int, first_key_junk: bool, next_claimed: bool, has_record: bool
) -> Tampering | None:
    """Why committing ``round`` at a successor key would fork the run: its first key holds
    junk and no key of it a record, yet a syncer claimed round ``round + 1``, which it does
    only once it holds the record of ``round``: the junk overwrote that record. None when the
    facts do not say so (a record at a successor key is the round's own)."""
    if not first_key_junk or not next_claimed or has_record:
        return None
    key = keys.record(round)
    return Tampering(
        key,
        f"{key} holds junk, yet round {round + 1} was claimed, which a syncer does only "
        f"once round {round} has its record: the record there was overwritten",
    )
