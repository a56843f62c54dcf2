"""The operator's side of learner identities: admit a learner's key, revoke a leaked one.

Both write one object under ``identities/`` of the run in ``mailbox``, signed with the run
key (``protocol.identities``). Nodes fold it in within ``identities.REFRESH_EVERY`` seconds
of their next look at snapshots or leases: an admitted key speaks for its learner from
then on; a revoked key's snapshots are rejected (``revoked``) and its beats ignored, while
rounds already committed stay as they are. Both run in the caller's event loop.
"""

from gradientmail.errors import NoRun, RunMismatch
from gradientmail.mailbox import Mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.identities import (
    Admission,
    Identities,
    Revocation,
    check_public_key,
    identity_key,
)
from gradientmail.protocol.records import Manifest, encode
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

__all__ = ["admit", "revoke"]


async def _run(mailbox: Mailbox, run_key: RunKey) -> tuple[Store, Manifest]:
    store = Store(mailbox, run_key=run_key)
    manifest = await store.manifest()
    if manifest is None:
        raise NoRun("no run in this store: start its first learner, then admit the others")
    if Identities.of(manifest) is None:
        raise RunMismatch(
            "the run has no learner identities (it was created by a node without a learner "
            "key): there is nothing to admit or revoke"
        )
    return store, manifest


async def _put(
    store: Store, manifest: Manifest, run_key: RunKey, obj: Admission | Revocation
) -> None:
    run = manifest.run_id if isinstance(manifest.run_id, str) else ""
    # Each object goes to a fresh random key: one taken (by junk) is no reason to stop.
    while True:
        key = identity_key(type(obj), obj.public_key)
        if await store.create(key, encode(run_key.sign(key, obj, run))):
            return


async def admit(mailbox: Mailbox, learner: str, public_key: str, run_key: RunKey) -> None:
    """Admit ``public_key`` (64 hex digits, ``LearnerKey.public``) to speak for ``learner``
    in the run in ``mailbox``. Raises ``NoRun`` before the run exists, ``RunMismatch`` for a
    run without identities or with another run key, ``ValueError`` for a malformed id or
    key."""
    keys.check_learner(learner)
    store, manifest = await _run(mailbox, run_key)
    await _put(
        store,
        manifest,
        run_key,
        Admission(learner=learner, public_key=check_public_key(public_key)),
    )


async def revoke(mailbox: Mailbox, public_key: str, run_key: RunKey) -> None:
    """Revoke ``public_key`` in the run in ``mailbox`` for the rest of the run, whichever
    learner it was admitted for. Raises as ``admit`` does."""
    store, manifest = await _run(mailbox, run_key)
    await _put(store, manifest, run_key, Revocation(public_key=check_public_key(public_key)))
