"""Signed runs: an HMAC-SHA256 on every manifest, claim, marker, snapshot and round record.

A run is signed when it was created with a ``RunKey``, a secret each node holds: never part
of the ``RunConfig``, never written to the store, never shown by ``repr``. The manifest
records only ``key_id``, an HMAC of a fixed label under the key, which tells keys apart and
reveals nothing of them.

The MAC covers a domain label, the run's id (empty for the manifest, creation claims, Θ⁰
markers and runs without one), the object's key in the run and the canonical JSON of the
object without its ``signature``, unknown fields included (``canonical``). Blobs are covered
by the sha256 the signed objects carry. Why each is bound: docs/reliability.md, "Signed
runs".

``RunKey.check(key, data)`` returns None for a good signature, ``"unsigned"`` or
``"bad-signature"`` (the reasons a round or a node reports); it raises ``RecordError`` only
for bytes that are not a JSON object of bounded size. ``check_manifest`` settles whether a
node may join a run.

Pure: no I/O, no clock; the comparison of MACs is constant-time.
"""

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec

from gradientmail.errors import Problem, RecordError, RunMismatch, SignatureError
from gradientmail.protocol.records import (
    DECODE_FAILURES,
    MAX_MANIFEST_BYTES,
    Manifest,
    _Object,
    decode_failure,
    encode,
)

__all__ = [
    "ENV_VAR",
    "MIN_KEY_BYTES",
    "Problem",
    "RunKey",
    "SignatureError",
    "canonical",
    "check_manifest",
]

ENV_VAR: Final = "GRADIENTMAIL_RUN_KEY"
"""The environment variable a node reads its run key from when it is given none."""
MIN_KEY_BYTES: Final = 16
"""The shortest secret accepted: shorter ones are guessable offline from any signed object."""

_LABEL: Final = b"gradientmail-signed-v1\x00"
_RUN_LABEL: Final = b"gradientmail-signed-v2\x00"
_ID_LABEL: Final = b"gradientmail-key-id"
_MAC_LABEL: Final = b"gradientmail-mac"

StoredT = TypeVar("StoredT", bound=_Object)

_canonical_encoder = msgspec.json.Encoder(order="sorted")


def _without_signature(value: object) -> object:
    if isinstance(value, dict):
        return {name: item for name, item in value.items() if name != "signature"}
    return value


def canonical(key: str, value: object, run: str = "") -> bytes:
    """The bytes a signature covers: the domain label, the run id ``run`` (when not empty),
    ``key`` and the canonical JSON of ``value`` (decoded JSON: dicts, lists, str, numbers,
    None) without a top-level ``signature``."""
    body = _canonical_encoder.encode(_without_signature(value))
    head = _RUN_LABEL + run.encode() + b"\x00" if run else _LABEL
    return head + key.encode() + b"\x00" + body


class RunKey:
    """The secret of a signed run. Build one from the secret (``str`` or ``bytes``, at least
    ``MIN_KEY_BYTES`` bytes) or with ``from_env``.

    The secret is kept only in this object, which shows its ``key_id`` and never the secret
    (``repr``, ``str``); ``ValueError``/``TypeError`` for a short or mistyped secret do not
    show it either. Two keys are equal when their secrets are. Thread-safe (immutable).
    """

    __slots__ = ("_mac_key", "key_id")

    key_id: str
    """16 hex digits that name the key: an HMAC of a fixed label, so it reveals nothing."""

    def __init__(self, secret: str | bytes) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, bytes):
            raise TypeError(f"a run key must be str or bytes, got {type(secret).__name__}")
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"a run key must be at least {MIN_KEY_BYTES} bytes, got {len(secret)}; "
                "use a long random secret (e.g. `python -c 'import secrets; "
                "print(secrets.token_hex(32))'`)"
            )
        self.key_id = hmac.new(secret, _ID_LABEL, hashlib.sha256).hexdigest()[:16]
        self._mac_key = hmac.new(secret, _MAC_LABEL, hashlib.sha256).digest()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RunKey | None":
        """The key in ``GRADIENTMAIL_RUN_KEY`` (of ``environ``, default ``os.environ``), or
        None when it is unset or empty."""
        value = (os.environ if environ is None else environ).get(ENV_VAR, "")
        if not value:
            return None
        try:
            return cls(value)
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR}: {exc}") from None

    def __repr__(self) -> str:
        return f"RunKey(key_id={self.key_id!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunKey):
            return NotImplemented
        return hmac.compare_digest(self._mac_key, other._mac_key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __reduce__(self) -> str:
        raise TypeError("a RunKey is not pickled: pass the secret to each process yourself")

    def _mac(self, key: str, value: object, run: str) -> str:
        return hmac.new(self._mac_key, canonical(key, value, run), hashlib.sha256).hexdigest()

    def sign(self, key: str, obj: StoredT, run: str = "") -> StoredT:
        """``obj``, to be stored under ``key`` in the run ``run`` (its id; empty before the
        run exists), with its ``signature`` (and, for a ``Manifest``, ``key_id``) set."""
        if isinstance(obj, Manifest):
            obj = msgspec.structs.replace(obj, key_id=self.key_id)
        unsigned = msgspec.structs.replace(obj, signature=msgspec.UNSET)
        value = msgspec.json.decode(encode(unsigned))
        return msgspec.structs.replace(obj, signature=self._mac(key, value, run))

    def check(self, key: str, data: bytes, run: str = "") -> Problem | None:
        """None when ``data``, read from ``key`` of the run ``run``, carries this key's
        signature over its content; else why not. Raises ``RecordError`` (only) when
        ``data`` is not a JSON object within the manifest's size limit."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise RecordError(f"{key}: {len(data)} bytes is over the {MAX_MANIFEST_BYTES} limit")
        try:
            value = msgspec.json.decode(data)
        except DECODE_FAILURES as exc:
            raise RecordError(f"{key}: not JSON: {decode_failure(exc)}") from exc
        if not isinstance(value, dict):
            raise RecordError(f"{key}: not a JSON object")
        signature = value.get("signature")
        if signature is None:
            return "unsigned"
        if not isinstance(signature, str) or not hmac.compare_digest(
            signature.encode("utf-8", "replace"), self._mac(key, value, run).encode()
        ):
            return "bad-signature"
        return None

    def verify(self, key: str, data: bytes, run: str = "") -> None:
        """``check``, raising ``SignatureError`` instead of returning a problem."""
        problem = self.check(key, data, run)
        if problem is not None:
            raise SignatureError(key, problem)


def check_manifest(manifest: Manifest, run_key: RunKey | None) -> None:
    """Raise ``RunMismatch`` unless a node holding ``run_key`` (None: no key) belongs in the
    run of ``manifest``: an unsigned run takes nodes without a key, a signed one only nodes
    with its key. The message names the key ids, never a key. The manifest's own signature
    is checked where its bytes are read (``RunKey.check``)."""
    signed = isinstance(manifest.key_id, str)
    if run_key is None and signed:
        raise RunMismatch(
            f"the run is signed (key id {manifest.key_id}) and this node has no run key; "
            f"pass run_key=... or set {ENV_VAR}"
        )
    if run_key is not None and not signed:
        raise RunMismatch(
            f"this node has a run key (id {run_key.key_id}) but the run's manifest is not "
            "signed: the run was created without a key, or someone without the key wrote its "
            f"manifest; drop the key to join it, or use another prefix for a signed run"
        )
    if run_key is not None and manifest.key_id != run_key.key_id:
        raise RunMismatch(
            f"the run is signed with another key (id {manifest.key_id}; this node's is "
            f"{run_key.key_id}); pass the run's key"
        )
