"""``gradientmail keygen``, ``admit`` and ``revoke``: learner keys for a run with identities.

The run key comes from ``GRADIENTMAIL_RUN_KEY``, the operator's admission key from the PEM
file ``GRADIENTMAIL_ADMISSION_KEY_FILE`` names (never from the command line, where other
users of the machine could read them). ``keygen`` makes learner keys and admission keys
alike: a key is an Ed25519 key pair, what it signs is up to whoever holds it.
"""

import os
from pathlib import Path

from gradientmail.admission import admit, revoke
from gradientmail.errors import UsageError
from gradientmail.protocol.identities import AdmissionKey, LearnerKey
from gradientmail.protocol.signing import ENV_VAR, RunKey
from gradientmail.reader import open_mailbox

__all__ = ["ADMISSION_KEY_ENV", "admit_at", "keygen", "revoke_at"]

ADMISSION_KEY_ENV = "GRADIENTMAIL_ADMISSION_KEY_FILE"
"""The environment variable naming the PEM file of the operator's admission key."""


def keygen(path: Path) -> str:
    """Write a new Ed25519 key to ``path`` (PEM, mode 0600; ``UsageError`` when it exists)
    and return its public key."""
    key = LearnerKey.generate()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UsageError(f"{path} exists: pick another path (a key is never overwritten)") from None
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "wb") as file:
        file.write(key.pem())
    return key.public


def _keys() -> tuple[RunKey, AdmissionKey]:
    """The run key and the admission key from the environment; ``UsageError`` naming the
    variable to set when one is missing or unusable."""
    run_key = RunKey.from_env()
    if run_key is None:
        raise UsageError(f"set {ENV_VAR} to the run key: it reads the run's signed manifest")
    path = os.environ.get(ADMISSION_KEY_ENV, "")
    if not path:
        raise UsageError(
            f"set {ADMISSION_KEY_ENV} to the file of the run's admission key: admissions and "
            "revocations are signed with it, not with the run key (`gradientmail keygen "
            "PATH` makes one; its public key is each node's NodeOptions(admission_key=...))"
        )
    try:
        return run_key, AdmissionKey.load(path)
    except ValueError as exc:
        raise UsageError(f"{ADMISSION_KEY_ENV}: {exc}") from None


async def admit_at(url: str, learner: str, public_key: str) -> None:
    """Admit ``public_key`` for ``learner`` in the run at ``url`` (``admission.admit``)."""
    run_key, admission_key = _keys()
    async with open_mailbox(url, must_exist=True) as mailbox:
        try:
            await admit(mailbox, learner, public_key, run_key, admission_key)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc


async def revoke_at(url: str, public_key: str) -> None:
    """Revoke ``public_key`` in the run at ``url`` (``admission.revoke``)."""
    run_key, admission_key = _keys()
    async with open_mailbox(url, must_exist=True) as mailbox:
        try:
            await revoke(mailbox, public_key, run_key, admission_key)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
