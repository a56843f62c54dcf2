"""The operator's side of learner identities: admit a learner's key, revoke a leaked one.

Both write one object under ``identities/`` of the run in ``mailbox``, signed with the
operator's ``AdmissionKey``, whose public key the run's manifest names
(``protocol.identities``); the run key only reads the manifest. Nodes fold it in within
``identities.REFRESH_EVERY`` seconds of their next look at snapshots or leases: an admitted
key speaks for its learner from then on; a revoked key's snapshots are rejected
(``revoked``) and its beats ignored, while rounds already committed stay as they are. Both
run in the caller's event loop.
"""

from gradientmail.errors import NoRun, RunMismatch
from gradientmail.mailbox import Mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.identities import (
    Admission,
    AdmissionKey,
    Identities,
    Revocation,
    check_public_key,
    identity_key,
)
from gradientmail.protocol.records import Manifest, encode
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

__all__ = ["admit", "revoke"]


async def _run(
    mailbox: Mailbox, run_key: RunKey, admission_key: AdmissionKey
) -> tuple[Store, Manifest]:
    """The run in ``mailbox`` and its manifest, once ``admission_key`` is the one it names."""
    if not isinstance(admission_key, AdmissionKey):
        raise TypeError(f"admission_key must be an AdmissionKey, got {admission_key!r}")
    store = Store(mailbox, run_key=run_key)
    manifest = await store.manifest()
    if manifest is None:
        raise NoRun("no run in this store: start its first learner, then admit the others")
    found = Identities.of(manifest)
    if found is None:
        raise RunMismatch(
            "the run has no learner identities (it was created by a node without a learner "
            "key): there is nothing to admit or revoke"
        )
    if found.authority != admission_key.public:
        raise RunMismatch(_wrong_authority(manifest, admission_key))
    return store, manifest


def _wrong_authority(manifest: Manifest, admission_key: AdmissionKey) -> str:
    if not isinstance(manifest.admission_key, str):
        return (
            "the run's manifest names no admission key, so nothing tells a node's admission "
            "from the operator's and no node joins it; start a new run"
        )
    return (
        f"the run's admission key is {manifest.admission_key}, not this one "
        f"({admission_key.public}); pass the key whose public key the run names"
    )


async def _put(
    store: Store, manifest: Manifest, admission_key: AdmissionKey, obj: Admission | Revocation
) -> None:
    run = manifest.run_id if isinstance(manifest.run_id, str) else ""
    # Each object goes to a fresh random key: one taken (by junk) is no reason to stop.
    while True:
        key = identity_key(type(obj), obj.public_key)
        if await store.create(key, encode(admission_key.sign(key, obj, run))):
            return


async def admit(
    mailbox: Mailbox, learner: str, public_key: str, run_key: RunKey, admission_key: AdmissionKey
) -> None:
    """Admit ``public_key`` (64 hex digits, ``LearnerKey.public``) to speak for ``learner``
    in the run in ``mailbox``, signed with ``admission_key``. Raises ``NoRun`` before the
    run exists, ``RunMismatch`` for a run without identities, with another run key or
    naming another admission key, ``ValueError`` for a malformed id or key."""
    keys.check_learner(learner)
    public = check_public_key(public_key)
    store, manifest = await _run(mailbox, run_key, admission_key)
    await _put(store, manifest, admission_key, Admission(learner=learner, public_key=public))


async def revoke(
    mailbox: Mailbox, public_key: str, run_key: RunKey, admission_key: AdmissionKey
) -> None:
    """Revoke ``public_key`` in the run in ``mailbox`` for the rest of the run, whichever
    learner it was admitted for, signed with ``admission_key``. Raises as ``admit`` does."""
    public = check_public_key(public_key)
    store, manifest = await _run(mailbox, run_key, admission_key)
    await _put(store, manifest, admission_key, Revocation(public_key=public))
