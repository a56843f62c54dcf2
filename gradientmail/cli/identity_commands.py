"""``gradientmail keygen``, ``admit`` and ``revoke``: learner keys for a run with identities.

The run key comes from ``GRADIENTMAIL_RUN_KEY`` (never from the command line, where other
users of the machine could read it).
"""

import os
from pathlib import Path

from gradientmail.admission import admit, revoke
from gradientmail.errors import UsageError
from gradientmail.protocol.identities import LearnerKey
from gradientmail.protocol.signing import ENV_VAR, RunKey
from gradientmail.reader import open_mailbox

__all__ = ["admit_at", "keygen", "revoke_at"]


def keygen(path: Path) -> str:
    """Write a new learner key to ``path`` (PEM, mode 0600; ``UsageError`` when it exists)
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


def _run_key() -> RunKey:
    key = RunKey.from_env()
    if key is None:
        raise UsageError(f"set {ENV_VAR} to the run key: admissions and revocations are signed")
    return key


async def admit_at(url: str, learner: str, public_key: str) -> None:
    """Admit ``public_key`` for ``learner`` in the run at ``url`` (``admission.admit``)."""
    key = _run_key()
    async with open_mailbox(url, must_exist=True) as mailbox:
        try:
            await admit(mailbox, learner, public_key, key)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc


async def revoke_at(url: str, public_key: str) -> None:
    """Revoke ``public_key`` in the run at ``url`` (``admission.revoke``)."""
    key = _run_key()
    async with open_mailbox(url, must_exist=True) as mailbox:
        try:
            await revoke(mailbox, public_key, key)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
