"""Learner identities: each learner signs its snapshots and lease beats with its own Ed25519 key.

A run has identities when its manifest lists learners' public keys (``Manifest.learners``,
learner id to 64 hex digits: its creator's, ``listed``); such a run is also signed
(``protocol.signing``) with the run key every node holds, and its manifest names the
operator's admission public key (``Manifest.admission_key``), the admission authority. An
``Admission`` (a learner id and a public key) or a ``Revocation`` (a public key) counts only
when it verifies under that key (``AdmissionKey``), never under the run key, so a node
cannot admit or revoke anyone. Each goes to a fresh key under ``identities/``, so junk there
blocks neither. A learner may have several admitted keys; a revoked key stays revoked for
the rest of the run. Nodes refuse a run with identities whose manifest names no admission
key (``Signing.check_member``).

A snapshot's or a beat's ``signature`` is ``ed25519:`` and the hex of an Ed25519 signature
over a label of its own and ``signing.canonical``'s bytes. ``Identities.check`` answers, for
the learner the object's key names: None (good), ``"unsigned"``, ``"not-admitted"`` (no
admitted key that is not revoked), ``"revoked"`` (it verifies only under a revoked key) or
``"bad-signature"`` (another learner's key, a run-key MAC, damage).

Pure: no I/O, no clock.
"""

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Final, TypeVar

import msgspec

from gradientmail.errors import Problem, RecordError, RunMismatch
from gradientmail.protocol import keys
from gradientmail.protocol.keypairs import KeyPair, verifies
from gradientmail.protocol.records import DECODE_FAILURES, MAX_RECORD_BYTES, Manifest, _Object
from gradientmail.protocol.records import decode as decode_record
from gradientmail.protocol.signing import RunKey, canonical

__all__ = [
    "IDENTITIES",
    "REFRESH_EVERY",
    "Admission",
    "AdmissionKey",
    "Identities",
    "LearnerKey",
    "Revocation",
    "Signing",
    "check_public_key",
    "identity_key",
    "listed",
    "parse_identity_key",
]

IDENTITIES: Final = "identities/"
"""Where admissions (``identities/admit/…``) and revocations (``identities/revoke/…``) live."""

REFRESH_EVERY: Final = 1.0
"""Seconds between listings of ``IDENTITIES`` by a node that judges snapshots or leases: how
long a revocation or an admission may take to reach it."""

_HEX: Final = frozenset("0123456789abcdef")

StoredT = TypeVar("StoredT", bound=_Object)


def check_public_key(public: str) -> str:
    """``public`` when it is a learner's public key as the run stores it (64 lowercase hex
    digits); else ``ValueError`` saying what one looks like."""
    if not isinstance(public, str) or len(public) != 64 or not set(public) <= _HEX:
        raise ValueError(
            f"a learner's public key is 64 lowercase hex digits (`gradientmail keygen` "
            f"prints one), got {public!r}"
        )
    return public


class Admission(_Object, frozen=True, kw_only=True):
    """``public_key`` speaks for ``learner`` from now on (signed with the admission key)."""

    learner: str
    public_key: str


class Revocation(_Object, frozen=True, kw_only=True):
    """``public_key`` speaks for nobody from now on (signed with the admission key)."""

    public_key: str


def identity_key(kind: type[Admission] | type[Revocation], public: str, nonce: str = "") -> str:
    """A fresh key for an admission or revocation of ``public`` (``nonce``: random hex)."""
    part = "admit" if kind is Admission else "revoke"
    return f"{IDENTITIES}{part}/{check_public_key(public)}/{nonce or secrets.token_hex(8)}"


def parse_identity_key(key: str) -> type[Admission] | type[Revocation] | None:
    """Which kind of object ``key`` holds, or None for a key outside the layout."""
    parts = key.split("/")
    if len(parts) != 4 or f"{parts[0]}/" != IDENTITIES or parts[1] not in ("admit", "revoke"):
        return None
    if len(parts[2]) != 64 or not set(parts[2]) <= _HEX or not 1 <= len(parts[3]) <= 64:
        return None
    return Admission if parts[1] == "admit" else Revocation


class LearnerKey(KeyPair):
    """A learner's private Ed25519 key: it signs the learner's snapshots and lease beats.
    ``KeyPair`` says how to build, keep and compare one."""

    __slots__ = ()
    KIND = "a learner key"
    LABEL = b"gradientmail-learner-v1\x00"


class AdmissionKey(KeyPair):
    """The operator's private Ed25519 admission key: it signs the admissions and
    revocations of the runs whose manifest names its public key (``Manifest.admission_key``).
    No node holds it. ``KeyPair`` says how to build, keep and compare one."""

    __slots__ = ()
    KIND = "an admission key"
    LABEL = b"gradientmail-admission-v1\x00"


def _body(key: str, data: bytes) -> dict[str, object]:
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{key}: {len(data)} bytes is over the {MAX_RECORD_BYTES} limit")
    try:
        value = msgspec.json.decode(data)
    except DECODE_FAILURES as exc:
        raise RecordError(f"{key}: not JSON") from exc
    if not isinstance(value, dict):
        raise RecordError(f"{key}: not a JSON object")
    return value


@dataclass(frozen=True, slots=True)
class Identities:
    """Who speaks for whom in a run with identities: each learner's admitted public keys,
    the revoked keys, and ``authority``, the admission public key the manifest names (None:
    it names none, and nothing is admitted or revoked)."""

    admitted: Mapping[str, frozenset[str]] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()
    authority: str | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> "Identities | None":
        """The identities ``manifest`` lists; None when its run has none."""
        if not isinstance(manifest.learners, dict):
            return None
        authority = manifest.admission_key if isinstance(manifest.admission_key, str) else None
        listed = {learner: frozenset([public]) for learner, public in manifest.learners.items()}
        return cls(listed, authority=authority)

    def admit(self, learner: str, public: str) -> "Identities":
        admitted = dict(self.admitted)
        admitted[learner] = admitted.get(learner, frozenset()) | {public}
        return replace(self, admitted=admitted)

    def revoke(self, public: str) -> "Identities":
        return replace(self, revoked=self.revoked | {public})

    def speaks_for(self, public: str, learner: str) -> bool:
        """Whether ``public`` is admitted for ``learner`` and not revoked."""
        return public in self.admitted.get(learner, ()) and public not in self.revoked

    def check(self, key: str, learner: str, data: bytes, run: str) -> Problem | None:
        """None when ``data`` (read from ``key`` of the run ``run``) carries a signature of
        an admitted, unrevoked key of ``learner``; else why not (module docstring). Raises
        ``RecordError`` (only) for bytes that are not a bounded JSON object."""
        value = _body(key, data)
        signature = value.get("signature")
        if signature is None:
            return "unsigned"
        owned = self.admitted.get(learner, frozenset())
        message = LearnerKey.LABEL + canonical(key, value, run)
        for public in owned:
            if verifies(public, signature, message):
                return "revoked" if public in self.revoked else None
        return "bad-signature" if owned - self.revoked else "not-admitted"

    def fold(self, key: str, data: bytes, run: str) -> "Identities":
        """These identities with the admission or revocation at ``key`` (of the run
        ``run``) applied when it is one that decodes, describes its key and verifies under
        ``authority``; raises ``RecordError`` naming what is wrong otherwise (``unsigned``,
        ``bad-signature``: not the admission key's, e.g. the run key's), for the caller to
        ignore it."""
        kind = parse_identity_key(key)
        if kind is None:
            raise RecordError(f"{key}: not an admission or revocation key")
        if self.authority is None:
            raise RecordError(f"{key}: the run's manifest names no admission key")
        value = _body(key, data)
        signature = value.get("signature")
        message = AdmissionKey.LABEL + canonical(key, value, run)
        if signature is None or not verifies(self.authority, signature, message):
            problem = "unsigned" if signature is None else "bad-signature"
            raise RecordError(f"{key}: {problem}: not signed with the run's admission key")
        obj = decode_record(data, kind)
        if obj.public_key != key.split("/")[2]:
            raise RecordError(f"{key}: names another public key than its key")
        if isinstance(obj, Admission):
            try:
                keys.check_learner(obj.learner)
            except ValueError as exc:
                raise RecordError(f"{key}: {exc}") from None
            return self.admit(obj.learner, obj.public_key)
        return self.revoke(obj.public_key)


def _check_authority(authority: str | None, expected: str | None) -> None:
    """``RunMismatch`` unless the run's admission key ``authority`` is ``expected``."""
    if authority is None:
        raise RunMismatch(
            "the run has learner identities but its manifest names no admission key, so "
            "nothing tells a node's admission from the operator's and no node joins it; "
            "start a new run with NodeOptions(admission_key=...)"
        )
    if authority != expected:
        raise RunMismatch(
            f"the run's admission key is {authority}, this node expects {expected}; pass "
            "the run's operator's admission public key as NodeOptions(admission_key=...)"
        )


def _learner_of(key: str) -> str | None:
    """The learner whose own key signs the object at ``key``: snapshots and lease beats."""
    snapshot = keys.parse_snapshot(key)
    if snapshot is not None:
        return snapshot[1]
    lease = keys.parse_lease(key)
    return None if lease is None else lease[0]


@dataclass(frozen=True, slots=True)
class Signing:
    """How one node signs and checks a run's objects: with the run key (None: unsigned
    run), and in a run with identities snapshots and beats with learner keys.

    ``seen``: the keys under ``IDENTITIES`` already folded in (or found junk);
    ``checked_at``: when they were last listed, on the node's clock."""

    run_key: RunKey | None = None
    learner_key: "LearnerKey | None" = None
    identities: Identities | None = None
    seen: frozenset[str] = frozenset()
    checked_at: float = -math.inf

    def learn(self, manifest: Manifest) -> "Signing":
        """This signing for the run of ``manifest``: its identities, or none. Raises
        ``RunMismatch`` when a node with a learner key joins a run without identities or a
        node without the run key joins a run with them."""
        found = Identities.of(manifest)
        if found is None and self.learner_key is not None:
            raise RunMismatch(
                f"this node has a learner key ({self.learner_key.public[:16]}…) but the run "
                "has no learner identities; drop the key to join it"
            )
        if found is not None and self.run_key is None:
            raise RunMismatch("the run has learner identities and this node has no run key")
        if self.identities is not None:
            return self
        return Signing(self.run_key, self.learner_key, found)

    def check_member(self, learner: str, admission_key: str | None) -> None:
        """Raise ``RunMismatch`` unless a node of ``learner`` with this signing, expecting
        the admission public key ``admission_key``, may write to the run: in a run with
        identities, only when the manifest names that admission key and with a learner key
        admitted for ``learner`` and not revoked."""
        if self.identities is None:
            return
        if self.learner_key is None:
            raise RunMismatch(
                "the run has learner identities and this node has no learner key; pass "
                "NodeOptions(learner_key=LearnerKey.load(...)) with a key admitted for it"
            )
        _check_authority(self.identities.authority, admission_key)
        public = self.learner_key.public
        if public in self.identities.revoked:
            raise RunMismatch(f"learner key {public} is revoked in this run; use a new key")
        if not self.identities.speaks_for(public, learner):
            raise RunMismatch(
                f"learner key {public} is not admitted for {learner!r} in this run; admit it "
                f"with `gradientmail admit URL {learner} {public}` (run key and admission key "
                "in the environment)"
            )

    def due(self, now: float) -> bool:
        """Whether ``IDENTITIES`` is to be listed again at ``now``: in a run with identities,
        ``REFRESH_EVERY`` after the last listing."""
        return self.identities is not None and now >= self.checked_at + REFRESH_EVERY

    def fold(self, key: str, data: bytes, run: str, now: float) -> "tuple[Signing, str | None]":
        """This signing with the object at ``key`` (of the run ``run``) folded in, listed at
        ``now``, and why it was ignored (None: it counts)."""
        seen = self.seen | {key}
        if self.identities is None or self.run_key is None:
            return self, "the run has no learner identities"
        try:
            found = self.identities.fold(key, data, run)
        except RecordError as exc:
            return replace(self, seen=seen, checked_at=now), str(exc)
        return replace(self, identities=found, seen=seen, checked_at=now), None

    def listed_at(self, now: float) -> "Signing":
        return replace(self, checked_at=now)

    def sign(self, key: str, obj: StoredT, run: str) -> StoredT:
        if self.run_key is None:
            return obj
        if self.identities is not None and self.learner_key is not None and _learner_of(key):
            return self.learner_key.sign(key, obj, run)
        return self.run_key.sign(key, obj, run)

    def check(self, key: str, data: bytes, run: str) -> Problem | None:
        """Why ``data`` read from ``key`` fails (None: it passes, or the run is unsigned);
        ``RecordError`` when it is not a bounded JSON object."""
        if self.run_key is None:
            return None
        learner = _learner_of(key) if self.identities is not None else None
        if self.identities is not None and learner is not None:
            return self.identities.check(key, learner, data, run)
        return self.run_key.check(key, data, run)


def listed(
    manifest: Manifest, learner_key: LearnerKey | None, admission_key: str | None
) -> Manifest:
    """``manifest`` as a node with ``learner_key`` creates it: a run with identities lists
    its creator's key, admitted from the start, and names the operator's ``admission_key``
    (a public key), which admits the others; unchanged without a learner key. Raises
    ``ValueError`` for a learner key without an admission key."""
    if learner_key is None:
        return manifest
    if admission_key is None:
        raise ValueError("a run with learner identities needs an admission key")
    return msgspec.structs.replace(
        manifest,
        learners={manifest.created_by: learner_key.public},
        admission_key=check_public_key(admission_key),
    )
