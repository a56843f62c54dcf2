"""A run's creation: its manifest, the creation claims and the Θ⁰ markers.

The manifest is create-once at the first of ``keys.manifest_slot`` not taken by junk: one
that does not decode or, in a signed run, does not verify is skipped for its successor. A
well-formed manifest of another kind of run is not skipped but refused (``RunMismatch``),
since it may be a real run at this prefix. Reading or writing the manifest teaches the
store the run's id, fragments and identities (``RunObjects.learn``) and the digest round 0
binds (``History.manifest``).

Runs in the node's tasks on the event loop, like the store.
"""

import secrets

import msgspec

from gradientmail._history import History
from gradientmail.errors import MailboxUnavailable, RecordError, SignatureError
from gradientmail.protocol import keys
from gradientmail.protocol.records import (
    MAX_MANIFEST_BYTES,
    CreateClaim,
    InitMarker,
    Manifest,
    decode,
    encode,
)
from gradientmail.protocol.signing import check_manifest
from gradientmail.store._blobs import sha256
from gradientmail.store._claims import check_claim, from_zero
from gradientmail.store._objects import RunObjects

__all__ = ["Creation"]


class Creation:
    """The manifest, creation claims and Θ⁰ markers of the run in ``objects``; what the
    manifest binds goes into ``history``."""

    def __init__(self, objects: RunObjects, history: History) -> None:
        self._objects = objects
        self._history = history

    async def manifest(self) -> Manifest | None:
        """The run's manifest: the first of ``keys.manifest_slot`` that decodes (and, in a
        signed run, verifies); None before the run exists.

        Raises ``RunMismatch`` when the run is signed and this store has no key (unless
        ``unverified``), or the other way round, or with another key: a well-formed manifest
        of another kind of run is not skipped, since it may be a real run at this prefix.
        """
        for slot in range(keys.SLOTS):
            key = keys.manifest_slot(slot)
            data = await self._objects.read(key, limit=MAX_MANIFEST_BYTES)
            if data is None:
                return None
            manifest = self._manifest_at(key, data)
            if manifest is not None:
                return self._learn(manifest, data)
        raise RecordError(f"every one of the {keys.SLOTS} manifest keys holds junk")

    async def create_manifest(self, manifest: Manifest) -> Manifest:
        """Write ``manifest`` (with a fresh random ``run_id`` unless it has one) at the first
        manifest key not taken by junk, unless the run has a manifest; return the run's
        manifest (ours or the winner's of a race)."""
        if not isinstance(manifest.run_id, str):
            manifest = msgspec.structs.replace(manifest, run_id=secrets.token_hex(16))
        for slot in range(keys.SLOTS):
            key = keys.manifest_slot(slot)
            signed = self._objects.signed(key, manifest)
            if await self._objects.requests.create(key, ours := encode(signed)):
                return self._learn(signed, ours)
            data = await self._objects.read(key, limit=MAX_MANIFEST_BYTES)
            if data is None:
                raise MailboxUnavailable(f"{key} was reported present but cannot be read")
            winner = self._manifest_at(key, data)
            if winner is not None:
                return self._learn(winner, data)
        raise RecordError(f"every one of the {keys.SLOTS} manifest keys holds junk")

    def _manifest_at(self, key: str, data: bytes) -> Manifest | None:
        """The manifest in ``data``, or None (remembered) when it is junk."""
        objects = self._objects
        if key in objects.junk:
            return None
        try:
            manifest = decode(data, Manifest)
        except RecordError as exc:
            objects.ignore(key, str(exc))
            return None
        if not objects.unverified:
            check_manifest(manifest, objects.run_key)
        problem = None
        if objects.run_key is not None:
            problem = objects.run_key.check(key, data)
        if problem is not None:
            objects.ignore(key, str(SignatureError(key, problem)))
            return None
        return manifest

    def _learn(self, manifest: Manifest, data: bytes) -> Manifest:
        self._history.manifest = sha256(data)
        signed = isinstance(manifest.key_id, str)
        self._history.checked = not self._objects.unverified or not signed
        self._objects.learn(manifest)
        return manifest

    async def create_claims(self) -> list[tuple[int, str]]:
        """``(attempt, claimant)`` of the creation claims numbered from 0 without a gap, in
        order (a claim after a gap is foreign); a claim that is malformed or does not verify
        under the run key names nobody (``""``)."""
        listed = await self._objects.requests.list_keys(keys.CREATE)
        claims = []
        for attempt in from_zero(keys.parse_create_claim(key) for key in listed):
            key = keys.create_claim(attempt)
            data = await self._objects.read(key)
            if data is None:
                break
            claims.append((attempt, self._objects.claimant(key, data, CreateClaim)))
        return claims

    async def claim_creation(self, attempt: int, learner: str) -> bool:
        """Take creation claim ``attempt``; ``RecordError`` when the layout has no such
        claim (every one before it was taken: the store is flooded)."""
        check_claim(attempt, "the run's creation")
        key = keys.create_claim(attempt)
        data = self._objects.encode(key, CreateClaim(learner=learner))
        return await self._objects.requests.create(key, data)

    async def put_init_marker(self, attempt: int, marker: InitMarker) -> None:
        """Write ``marker``, a sign of creation ``attempt``'s progress on its fragment."""
        key = keys.init_marker(attempt, marker.fragment)
        await self._objects.requests.create(key, self._objects.encode(key, marker))

    async def init_markers(self, attempt: int) -> list[str]:
        """The keys of ``attempt``'s Θ⁰ markers; in a signed run only those that verify, as
        a forged marker is no sign of a creator's progress."""
        found = [
            key
            for key in await self._objects.requests.list_keys(keys.init_prefix(attempt))
            if keys.parse_init_marker(key) is not None
        ]
        if self._objects.run_key is None:
            return found
        verified = []
        for key in found:
            data = await self._objects.read(key)
            try:
                if data is not None and self._objects.problem(key, data) is None:
                    verified.append(key)
            except RecordError:
                continue
        return verified
