"""Ed25519 key pairs as a run stores them: a private key that signs objects under a label
of its kind, and its public key as 64 lowercase hex digits.

``KeyPair`` is the shared body of ``identities.LearnerKey`` (a learner's snapshots and
beats) and ``identities.AdmissionKey`` (the operator's admissions and revocations): each
kind signs under its own label, so a signature of one kind never verifies as the other.

Pure: no I/O beyond ``KeyPair.load`` reading the file it is given, no clock.
"""

from pathlib import Path
from typing import ClassVar, Final, Self, TypeVar

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gradientmail.protocol.records import _Object
from gradientmail.protocol.records import encode as encode_record
from gradientmail.protocol.signing import canonical

__all__ = ["PREFIX", "KeyPair", "verifies"]

PREFIX: Final = "ed25519:"
"""How a ``signature`` field holding an Ed25519 signature (in hex) begins."""

StoredT = TypeVar("StoredT", bound=_Object)


class KeyPair:
    """A private Ed25519 key of one kind (``KIND``, signing under ``LABEL``). Build one
    with ``generate``, ``from_pem`` or ``load`` (a PEM file, PKCS#8, unencrypted, as
    ``gradientmail keygen`` writes it).

    ``public`` is its 64 hex digits; ``repr`` shows only those, and the key is never
    pickled. Two keys of a kind are equal when their public keys are. Thread-safe
    (immutable).
    """

    __slots__ = ("_private", "public")

    KIND: ClassVar[str]
    LABEL: ClassVar[bytes]
    public: str

    def __init__(self, private: Ed25519PrivateKey) -> None:
        if not isinstance(private, Ed25519PrivateKey):
            raise TypeError(f"{self.KIND} is an Ed25519 key, got {type(private).__name__}")
        self._private = private
        raw = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public = raw.hex()

    @classmethod
    def generate(cls) -> Self:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes) -> Self:
        """The key in ``pem``; ``ValueError`` when it is not an unencrypted Ed25519 key."""
        try:
            private = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(
                "not an unencrypted PEM private key (`gradientmail keygen` writes one)"
            ) from exc
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError(f"{cls.KIND} is Ed25519, this one is {type(private).__name__}")
        return cls(private)

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """The key in the PEM file ``path``; ``ValueError`` naming the file when it is not
        one or cannot be read."""
        try:
            return cls.from_pem(Path(path).read_bytes())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        except OSError as exc:
            raise ValueError(f"{path}: cannot read {cls.KIND}: {exc.strerror or exc}") from None

    def pem(self) -> bytes:
        """The private key as PEM (PKCS#8, unencrypted): keep it as secret as the run key."""
        return self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(public={self.public!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyPair) or type(other) is not type(self):
            return NotImplemented
        return self.public == other.public

    def __hash__(self) -> int:
        return hash(self.public)

    def __reduce__(self) -> str:
        raise TypeError(
            f"a {type(self).__name__} is not pickled: pass its file to each process yourself"
        )

    def sign(self, key: str, obj: StoredT, run: str) -> StoredT:
        """``obj``, to be stored under ``key`` of the run ``run``, with its ``signature``."""
        unsigned = msgspec.structs.replace(obj, signature=msgspec.UNSET)
        value = msgspec.json.decode(encode_record(unsigned))
        signature = self._private.sign(self.LABEL + canonical(key, value, run))
        return msgspec.structs.replace(obj, signature=PREFIX + signature.hex())


def verifies(public: str, signature: object, message: bytes) -> bool:
    """Whether the ``signature`` field ``signature`` holds an Ed25519 signature of
    ``message`` under ``public`` (hex); False for anything malformed."""
    if not isinstance(signature, str) or not signature.startswith(PREFIX):
        return False
    try:
        raw = bytes.fromhex(signature.removeprefix(PREFIX))
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(raw, message)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
