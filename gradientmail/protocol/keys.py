"""The layout of a run in its mailbox: the one module that knows where every object lives.

Keys are relative to the mailbox (whose prefix or directory scopes the run); every write is
create-once and each kind of key has one kind of writer (the table: docs/protocol.md, "The
run in the store"). The manifest, a round's record and a learner's snapshot have numbered
successor keys (``n`` from 1 to ``SLOTS - 1``), to which every honest node moves on past
junk; claims count from 0 without a gap. Round ``r`` of a run with ``F`` fragments produces
version ``r // F + 1`` of fragment ``r % F``; version 0 of every fragment is Θ⁰. Numbers are
zero-padded, so byte order is numeric order in listings; builders raise ``ValueError`` for
what a key cannot hold. A lease beat's ``role`` (``Role``) says whether its node trains.

Pure: string functions only.
"""

import re
from typing import Literal, TypeAlias

__all__ = [
    "BLOBS",
    "CLAIMS",
    "CREATE",
    "INIT",
    "LEASES",
    "MANIFEST",
    "RECORDS",
    "ROUNDS",
    "SLOTS",
    "Role",
    "blob",
    "check_learner",
    "claims_prefix",
    "create_claim",
    "fragment_of",
    "init_marker",
    "init_prefix",
    "lease",
    "lease_prefix",
    "manifest_slot",
    "parse_blob",
    "parse_claim",
    "parse_create_claim",
    "parse_init_marker",
    "parse_lease",
    "parse_record",
    "parse_record_slot",
    "parse_snapshot",
    "parse_snapshot_slot",
    "record",
    "record_slot",
    "round_claim",
    "round_of",
    "round_prefix",
    "rounds_span",
    "snapshot",
    "snapshot_slot",
    "snapshots_prefix",
    "trains",
    "version_of",
]

MANIFEST = "manifest"
CREATE = "create/"
INIT = "init/"
LEASES = "leases/"
ROUNDS = "rounds/"
RECORDS = "records/"
BLOBS = "blobs/"
CLAIMS = "claims/"
SLOTS = 10_000
"""How many keys (the first and its successors) a manifest or a round's record may take, and
how many claims a round or the run's creation may take."""

Role: TypeAlias = Literal["learner", "closing", "syncer"]
"""What a lease says of its holder: ``learner`` trains (and counts toward a round's quorum
from the moment it joins), ``closing`` is a learner that began closing (it still counts: its
flush and final snapshots are to come, ahead of the rounds' pace), ``syncer`` only closes
rounds (its lease lets others judge its claims)."""
_ROLES: tuple[Role, ...] = ("learner", "closing", "syncer")

_LEARNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIGITS = re.compile(r"[0-9]+")


def check_learner(learner: str) -> str:
    """Return ``learner`` if it can name a node, else raise ``ValueError`` saying why.

    A learner id is one key segment: 1 to 128 characters of letters, digits, ``.``, ``_``
    and ``-``, starting with a letter or digit.
    """
    if not isinstance(learner, str) or _LEARNER.fullmatch(learner) is None:
        raise ValueError(
            f"invalid learner id {learner!r}: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return learner


def _number(text: str, width: int) -> int | None:
    return int(text) if len(text) == width and _DIGITS.fullmatch(text) else None


def _digits(value: int, width: int, what: str) -> str:
    """``value`` zero-padded to ``width`` digits; ``ValueError`` if it does not fit, since a
    wider or negative number would break the byte order of listings."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**width:
        raise ValueError(f"{what} must be an integer in [0, {10**width}), got {value!r}")
    return f"{value:0{width}d}"


def create_claim(attempt: int) -> str:
    return f"{CREATE}{_digits(attempt, 4, 'attempt')}"


def parse_create_claim(key: str) -> int | None:
    """The attempt of a ``create/`` key, or None for a key outside the layout."""
    rest = key.removeprefix(CREATE)
    return None if rest == key else _number(rest, 4)


def init_prefix(attempt: int) -> str:
    return f"{INIT}{_digits(attempt, 4, 'attempt')}/"


def init_marker(attempt: int, fragment: int) -> str:
    return f"{init_prefix(attempt)}{_digits(fragment, 4, 'fragment')}"


def parse_init_marker(key: str) -> tuple[int, int] | None:
    """``(attempt, fragment)`` of an ``init/`` key, or None for a key outside the layout."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != INIT.rstrip("/"):
        return None
    attempt, fragment = _number(parts[1], 4), _number(parts[2], 4)
    return None if attempt is None or fragment is None else (attempt, fragment)


def lease_prefix(learner: str) -> str:
    return f"{LEASES}{check_learner(learner)}/"


def lease(learner: str, beat: int, role: Role) -> str:
    if role not in _ROLES:
        raise ValueError(f"a lease's role is one of {', '.join(_ROLES)}, got {role!r}")
    return f"{lease_prefix(learner)}{_digits(beat, 12, 'beat')}.{role}"


def parse_lease(key: str) -> tuple[str, int, Role] | None:
    """``(learner, beat, role)`` of a ``leases/`` key, or None for a key outside the layout."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != LEASES.rstrip("/") or _LEARNER.fullmatch(parts[1]) is None:
        return None
    number, _, role = parts[2].partition(".")
    beat = _number(number, 12)
    known = next((r for r in _ROLES if r == role), None)
    if beat is None or known is None:
        return None
    return parts[1], beat, known


def trains(role: Role) -> bool:
    """Whether a lease of ``role`` is a learner's (``learner`` or ``closing``)."""
    return role != "syncer"


def round_prefix(round: int) -> str:
    return f"{ROUNDS}{_digits(round, 10, 'round')}/"


def snapshots_prefix(round: int) -> str:
    return f"{round_prefix(round)}snapshots/"


def rounds_span(first: int, last: int) -> tuple[str, str]:
    """``(prefix, after)``: one listing of every key of the rounds ``first`` to ``last``
    (``first <= last``), and of no round before ``first``; it may list rounds after
    ``last`` that share their leading digits."""
    if first > last:
        raise ValueError(f"rounds_span: first round {first} is after the last, {last}")
    low, high = round_prefix(first), round_prefix(last)
    shared = next((i for i, (a, b) in enumerate(zip(low, high, strict=True)) if a != b), len(low))
    return low[:shared], low.removesuffix("/")


def snapshot(round: int, learner: str) -> str:
    return f"{snapshots_prefix(round)}{check_learner(learner)}"


def snapshot_slot(round: int, learner: str, slot: int) -> str:
    """The ``slot``-th key ``learner``'s snapshot of ``round`` may take: ``snapshot(round,
    learner)``, then ``…/{learner}~{slot:04d}`` (``~`` is in no learner id)."""
    first = snapshot(round, learner)
    return first if slot == 0 else f"{first}~{_digits(slot, 4, 'snapshot slot')}"


def parse_snapshot_slot(key: str) -> tuple[int, str, int] | None:
    """``(round, learner, slot)`` of a snapshot key, or None for a key outside the layout."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != ROUNDS.rstrip("/") or parts[2] != "snapshots":
        return None
    round = _number(parts[1], 10)
    learner, tilde, successor = parts[3].partition("~")
    slot = _number(successor, 4) if tilde else 0
    if round is None or slot is None or (tilde and slot == 0):
        return None
    if _LEARNER.fullmatch(learner) is None:
        return None
    return round, learner, slot


def parse_snapshot(key: str) -> tuple[int, str] | None:
    """``(round, learner)`` of a snapshot key (of any slot), or None for a key outside the
    layout."""
    parsed = parse_snapshot_slot(key)
    return None if parsed is None else parsed[:2]


def parse_round_key(key: str) -> int | None:
    """The round of any key under ``ROUNDS`` (a snapshot, a claim, or anything written
    there), or None for a key outside the layout."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != ROUNDS.rstrip("/"):
        return None
    return _number(parts[1], 10)


def claims_prefix(round: int) -> str:
    return f"{round_prefix(round)}{CLAIMS}"


def round_claim(round: int, k: int) -> str:
    """The key of the ``k``-th claim to close ``round``."""
    return f"{claims_prefix(round)}{_digits(k, 4, 'claim number')}"


def parse_claim(key: str) -> tuple[int, int] | None:
    """``(round, k)`` of a round-claim key, or None for a key outside the layout."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != ROUNDS.rstrip("/") or parts[2] != CLAIMS.rstrip("/"):
        return None
    round, k = _number(parts[1], 10), _number(parts[3], 4)
    return None if round is None or k is None else (round, k)


def manifest_slot(slot: int) -> str:
    """The ``slot``-th key the manifest may take: ``manifest``, then its successors."""
    return MANIFEST if slot == 0 else f"{MANIFEST}.{_digits(slot, 4, 'manifest slot')}"


def record(round: int) -> str:
    return f"{RECORDS}{_digits(round, 10, 'round')}"


def record_slot(round: int, slot: int) -> str:
    """The ``slot``-th key the record of ``round`` may take: ``record(round)``, then its
    successors (which sort after it and before the next round's)."""
    first = record(round)
    return first if slot == 0 else f"{first}.{_digits(slot, 4, 'record slot')}"


def parse_record_slot(key: str) -> tuple[int, int] | None:
    """``(round, slot)`` of a ``records/`` key, or None for a key outside the layout."""
    rest = key.removeprefix(RECORDS)
    if rest == key:
        return None
    number, dot, successor = rest.partition(".")
    round = _number(number, 10)
    slot = _number(successor, 4) if dot else 0
    if round is None or slot is None or (dot and slot == 0):
        return None
    return round, slot


def parse_record(key: str) -> int | None:
    """The round of a ``records/`` key (of any slot), or None for a key outside the layout."""
    parsed = parse_record_slot(key)
    return None if parsed is None else parsed[0]


def blob(sha256: str) -> str:
    if _SHA256.fullmatch(sha256) is None:
        raise ValueError(f"invalid blob digest {sha256!r}: expected 64 lowercase hex digits")
    return f"{BLOBS}{sha256}"


def parse_blob(key: str) -> str | None:
    """The sha256 of a ``blobs/`` key, or None for a key outside the layout."""
    rest = key.removeprefix(BLOBS)
    return rest if rest != key and _SHA256.fullmatch(rest) is not None else None


def _check_round(round: int, fragments: int) -> None:
    if round < 0 or fragments < 1:
        raise ValueError(f"no round {round} in a run of {fragments} fragments")


def fragment_of(round: int, fragments: int) -> int:
    """The fragment round ``round`` updates."""
    _check_round(round, fragments)
    return round % fragments


def version_of(round: int, fragments: int) -> int:
    """The version of its fragment that round ``round`` produces (Θ⁰ is version 0)."""
    _check_round(round, fragments)
    return round // fragments + 1


def round_of(fragment: int, version: int, fragments: int) -> int:
    """The round that produces ``version`` (at least 1) of ``fragment``."""
    if version < 1 or not 0 <= fragment < fragments:
        raise ValueError(f"no round produces version {version} of fragment {fragment}")
    return (version - 1) * fragments + fragment
