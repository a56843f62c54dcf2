"""Transport: four async operations over immutable, create-once objects (and a ranged read,
``RangedMailbox``, that every backend here has), and its backends.

``MemoryMailbox`` (tests, one process), ``LocalMailbox`` (a directory: the embedded default)
and ``S3Mailbox`` (any S3-compatible store), each an async context manager. ``open(url)``
builds one from a URL; ``FaultyMailbox`` wraps any of them to inject failures. See
``docs/mailbox.md`` for the contract and the consistency assumed of the store.

``S3Mailbox`` is imported on first use: aiobotocore takes about a second to import, which
users of the other backends need not pay.
"""

from typing import TYPE_CHECKING

from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox._base import (
    MAX_KEY_BYTES,
    Mailbox,
    NotARegularFile,
    ObjectRefused,
    ObjectTooLarge,
    RangedMailbox,
    check_key,
    check_prefix,
    retrying,
)
from gradientmail.mailbox.faults import FaultCounts, Faults, FaultyMailbox
from gradientmail.mailbox.local import LocalAccessError, LocalMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.url import open

if TYPE_CHECKING:
    from gradientmail.mailbox.s3 import MAX_OBJECT_BYTES, S3AccessError, S3Mailbox

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_OBJECT_BYTES",
    "FaultCounts",
    "Faults",
    "FaultyMailbox",
    "LocalAccessError",
    "LocalMailbox",
    "Mailbox",
    "MailboxUnavailable",
    "MemoryMailbox",
    "NotARegularFile",
    "ObjectRefused",
    "ObjectTooLarge",
    "RangedMailbox",
    "S3AccessError",
    "S3Mailbox",
    "check_key",
    "check_prefix",
    "open",
    "retrying",
]

_LAZY = frozenset({"MAX_OBJECT_BYTES", "S3AccessError", "S3Mailbox"})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from gradientmail.mailbox import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
