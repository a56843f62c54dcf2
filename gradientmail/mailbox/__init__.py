"""Transport: four async operations over immutable, create-once objects, and its backends.

``MemoryMailbox`` (tests, one process), ``LocalMailbox`` (a directory: the embedded default)
and ``S3Mailbox`` (any S3-compatible store), each an async context manager. ``open(url)``
builds one from a URL. See ``docs/mailbox.md`` for the contract and the consistency assumed
of the store.
"""

from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox._base import MAX_KEY_BYTES, Mailbox, check_key, check_prefix, retrying
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.s3 import MAX_OBJECT_BYTES, S3Mailbox
from gradientmail.mailbox.url import open

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_OBJECT_BYTES",
    "LocalMailbox",
    "Mailbox",
    "MailboxUnavailable",
    "MemoryMailbox",
    "S3Mailbox",
    "check_key",
    "check_prefix",
    "open",
    "retrying",
]
