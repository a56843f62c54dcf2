"""A run's small objects (manifest, claims, markers, beats, snapshots, records) as one store
reads and writes them: signed on the way out, decoded and checked on the way in, junk
remembered.

Everything read is hostile until checked: an object that does not decode, or in a signed run
does not verify under the run key and the run's id, is junk. Junk keys are remembered (so
each is read once) and the newest are listed with why in ``RunObjects.ignored``. In a signed
run every signature covers the run's id (``Manifest.run_id``), learned from the manifest
(``RunObjects.learn``); with learner identities, the admissions and revocations are folded
in as they appear (``refresh_identities``).

Runs in the node's tasks on the event loop, like the store.
"""

import logging
from collections.abc import Container, Mapping
from typing import TypeVar

from gradientmail.errors import RecordError, SignatureError
from gradientmail.mailbox import ObjectRefused
from gradientmail.protocol import keys
from gradientmail.protocol.identities import IDENTITIES, LearnerKey, Signing
from gradientmail.protocol.records import (
    MAX_RECORD_BYTES,
    CreateClaim,
    Manifest,
    RoundClaim,
    _Object,
    decode,
    encode,
)
from gradientmail.protocol.signing import Problem, RunKey
from gradientmail.store._requests import Requests

__all__ = ["CACHED_ROUNDS", "RunObjects"]

_log = logging.getLogger("gradientmail.store")

S = TypeVar("S", bound=_Object)

CACHED_ROUNDS = 64
"""How many rounds behind the newest asked about a create-once body stays remembered."""
_JUNK_KEPT = 1 << 16
"""How many junk keys a store remembers (the newest): forgetting one costs a read again."""
_IGNORED_SHOWN = 100
"""How many skipped keys ``RunObjects.ignored`` keeps (the newest)."""


class RunObjects:
    """The run's objects through ``requests``, signed with ``run_key`` (and ``learner_key``,
    this node's own key in a run with learner identities) and checked against it.

    ``unverified`` (read-only use, without ``run_key``): a signed run is read without
    checking anything; ``Creation.manifest`` refuses it otherwise (``RunMismatch``).
    """

    def __init__(
        self,
        requests: Requests,
        *,
        run_key: RunKey | None = None,
        learner_key: LearnerKey | None = None,
        unverified: bool = False,
    ) -> None:
        self.requests = requests
        self.run_key = run_key
        self.signing = Signing(run_key, learner_key)
        self.unverified = unverified and run_key is None
        self.fragments: int | None = None
        """The run's number of fragments, once its manifest is read."""
        self._run = ""
        self._junk: dict[str, None] = {}
        self._ignored: dict[str, str] = {}

    @property
    def junk(self) -> Container[str]:
        """The keys remembered as junk (live: it grows as junk is found)."""
        return self._junk

    @property
    def ignored(self) -> Mapping[str, str]:
        """The newest keys skipped as junk (malformed, unverified or misfiled objects at
        create-once keys), each with why."""
        return dict(self._ignored)

    def ignore(self, key: str, why: str) -> None:
        """Remember ``key`` as junk, for ``why`` (logged the first time)."""
        if key not in self._junk:
            _log.warning("%s: skipped: %s", key, why)
        self._junk[key] = None
        while len(self._junk) > _JUNK_KEPT:
            del self._junk[next(iter(self._junk))]
        self._ignored[key] = why
        while len(self._ignored) > _IGNORED_SHOWN:
            del self._ignored[next(iter(self._ignored))]

    async def read(
        self, key: str, *, limit: int = MAX_RECORD_BYTES, attempts: int | None = None
    ) -> bytes | None:
        """The bytes of the object at ``key``, or None. One the mailbox refuses unread (over
        ``limit``, or not a regular file) is junk: it comes back as empty bytes, which fail
        to decode, so every walk skips it as it skips any malformed object."""
        try:
            return await self.requests.get(key, attempts=attempts, max_bytes=limit)
        except ObjectRefused as exc:
            self.ignore(key, str(exc))
            return b""

    def learn(self, manifest: Manifest) -> None:
        """Take the run's id, fragments and (unless ``unverified``) identities from its
        ``manifest``."""
        self._run = manifest.run_id if isinstance(manifest.run_id, str) else ""
        self.fragments = manifest.config.fragments
        if not self.unverified:
            self.signing = self.signing.learn(manifest)

    async def refresh_identities(self, *, now: bool = False) -> bool:
        """In a run with learner identities, fold in the admissions and revocations not yet
        seen (into ``signing``), listing them at most every ``REFRESH_EVERY`` seconds unless
        ``now``; whether any was new."""
        at, before = self.requests.clock.now(), self.signing.identities
        if before is None or not (now or self.signing.due(at)):
            return False
        self.signing = self.signing.listed_at(at)
        for key in await self.requests.list_keys(IDENTITIES):
            if key not in self.signing.seen:
                data = await self.read(key) or b""
                self.signing, why = self.signing.fold(key, data, self._run, at)
                if why is not None:
                    self.ignore(key, why)
        return self.signing.identities != before

    def _run_of(self, key: str) -> str:
        """The run id ``key``'s signature covers: none before the run exists (creation
        claims, Θ⁰ markers) and for the manifest, whose body holds it."""
        if key.startswith((keys.CREATE, keys.INIT, keys.MANIFEST)):
            return ""
        return self._run

    def signed(self, key: str, obj: S) -> S:
        """``obj`` as written at ``key``: signed in a signed run."""
        return self.signing.sign(key, obj, self._run_of(key))

    def encode(self, key: str, obj: S) -> bytes:
        """The bytes of ``obj`` as written at ``key`` (``signed``)."""
        return encode(self.signed(key, obj))

    def problem(self, key: str, data: bytes) -> Problem | None:
        """Why ``data`` fails this store's run key (None: it passes, or the run is not
        signed); ``RecordError`` when it is not a bounded JSON object."""
        return self.signing.check(key, data, self._run_of(key))

    def decode(self, key: str, data: bytes, kind: type[S]) -> S:
        """``data`` read from ``key`` as a ``kind``; ``RecordError`` naming the key."""
        problem = self.problem(key, data)
        if problem is not None:
            raise SignatureError(key, problem)
        try:
            return decode(data, kind)
        except RecordError as exc:
            raise RecordError(f"{key}: {exc}") from exc

    def claimant(self, key: str, data: bytes, kind: type[CreateClaim] | type[RoundClaim]) -> str:
        """Who holds the claim at ``key``: nobody (``""``) when it is malformed or does not
        verify, so that it is taken over instead of failing its round forever."""
        try:
            return self.decode(key, data, kind).learner
        except RecordError as exc:
            self.ignore(key, f"{exc}; counted as nobody's claim")
            return ""
