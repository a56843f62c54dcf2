"""The exceptions gradientmail raises, under one root and named by whose fault they are.

Transient, nobody's fault (retry):
    ``MailboxUnavailable``: the store is (for now) out of reach; ``Store`` retries it.
The store's content (or whoever wrote it), never the caller:
    ``RecordError``: an object is malformed (not JSON, wrong types, over its size limit,
    unknown format); its kinds ``CodecError`` (a blob that is not a well-formed encoding of
    its fragment) and ``SignatureError`` (an object of a signed run that does not verify).
    ``CorruptBlob``: a blob's bytes do not hash to their name.
    ``StoreTampered``: a committed round record was overwritten (the history's chain breaks
    at the key it names); never retried: it fails the node.
The operator's (fix the store's settings), raised by the mailboxes and never retried:
    ``StoreAccessError``: the store refused us for a reason no retry fixes. Its kinds are
    ``mailbox.S3AccessError`` (also a botocore ``ClientError``: no bucket, access denied,
    credentials refused, wrong region) and ``mailbox.LocalAccessError`` (also an
    ``OSError``: disk full, over quota, read-only, denied). A node's loops report and
    retry only the transient and the store's-content kinds above; this one fails the node.
The caller's (fix the model, config, key or command):
    ``RunMismatch``: this node's model, config or run key contradicts the run in the store;
    the store is left untouched.
    ``NoRun``: a reader was pointed at a store that holds no run (yet).
    ``UsageError``: a command's arguments are wrong (a bad URL, a missing directory or
    file); the command line prints its message without a traceback.
A node's own task:
    ``NodeFailed``: a task of a node died; raised from ``step()`` with the cause chained.
    ``GroupFailed`` (a ``NodeFailed``): another rank of this node's learner group left, died
    or fell out of step; raised from ``step()`` and the block on every rank.
"""

from typing import Literal, TypeAlias

__all__ = [
    "CodecError",
    "CorruptBlob",
    "GradientmailError",
    "GroupFailed",
    "MailboxUnavailable",
    "NoRun",
    "NodeFailed",
    "Problem",
    "RecordError",
    "RunMismatch",
    "SignatureError",
    "StoreAccessError",
    "StoreTampered",
    "UsageError",
]

Problem: TypeAlias = Literal["unsigned", "bad-signature", "not-admitted", "revoked"]
"""Why a signed run ignores an object (the ``RejectReason`` values of the same names): the
last two only for a learner's own objects in a run with identities."""


class GradientmailError(Exception):
    """Root of every exception gradientmail defines."""


class MailboxUnavailable(GradientmailError):
    """A transient transport failure (timeout, refused or dropped connection, conflict).

    Only this is retried by ``retrying``; every other store error propagates at once.
    """


class StoreAccessError(GradientmailError):
    """The store refused us for a reason a retry will not fix: the credentials are refused,
    access is denied, the bucket is missing or in another region, the filesystem is
    read-only, full or denies this user. Only the operator can fix it, so nothing retries
    it: a node whose task meets it fails at once (``NodeFailed`` with this chained), and a
    command prints it and exits.

    Raised by the mailboxes as their own kinds, which keep the backend's exception type
    too: ``mailbox.S3AccessError`` (a botocore ``ClientError``) and
    ``mailbox.LocalAccessError`` (an ``OSError`` with the original ``errno``). The message
    names the bucket or directory and what to do.
    """


class CorruptBlob(GradientmailError):
    """A blob's bytes do not hash to the sha256 its key and its reference name."""


class RecordError(GradientmailError):
    """A record, snapshot, claim or manifest in the store is malformed: not JSON, the wrong
    types, nested too deep, over the size limit, or of a format version this code does not
    know. Every failure to decode bytes read from the store is one of these."""


class CodecError(RecordError):
    """A blob is not a well-formed encoding of the fragment it is decoded for.

    ``reason`` is ``"shape"`` when the blob is a well-formed fragment blob whose fragment,
    names, shapes or sizes disagree with the spec (another model or fragment), and
    ``"corrupt"`` for anything else (not safetensors, unknown format or encoding, wrong
    dtypes, values out of range). A round rejects the snapshot with that reason.
    """

    def __init__(self, message: str, *, reason: Literal["corrupt", "shape"] = "corrupt"):
        super().__init__(message)
        self.reason: Literal["corrupt", "shape"] = reason


_SIGNATURE_PROBLEMS: dict[str, str] = {
    "unsigned": "carries no signature",
    "bad-signature": "has a signature that fails under the run's or its learner's key",
    "not-admitted": "names a learner with no admitted key",
    "revoked": "is signed with a revoked learner key",
}


class SignatureError(RecordError):
    """An object of a signed run is unsigned or its signature does not verify.

    ``reason`` is a ``Problem``; ``key`` the object's key.
    """

    def __init__(self, key: str, reason: Problem) -> None:
        super().__init__(
            f"{key}: {_SIGNATURE_PROBLEMS[reason]} ({reason}); it was written by someone "
            "without the key, or damaged, and is ignored"
        )
        self.key = key
        self.reason: Problem = reason


class StoreTampered(GradientmailError):
    """Someone who can overwrite the store's objects replaced a committed round record: the
    record at ``key`` is not the one the history after it was committed on
    (``protocol.chain``). No retry fixes it and no node commits over it: the store's owner
    restores the record (from a versioned copy) or starts a new run, and turns on object lock
    or versioning."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{why}; restore {key} from a versioned copy or start a new run")
        self.key = key


class RunMismatch(GradientmailError):
    """This node's model or config contradicts the run's manifest.

    The message names the first difference (a parameter's name, shape or dtype, or a config
    field) and what to do about it.
    """


class NoRun(GradientmailError):
    """The store holds no run: no manifest (the message says whether one is being created)."""


class UsageError(GradientmailError):
    """A command was given something it cannot use; the message says what and what to do."""


class NodeFailed(GradientmailError):
    """A task of the node failed; the original exception is chained as ``__cause__``."""


class GroupFailed(NodeFailed):
    """The learner group this node's rank belongs to cannot go on: another rank left the
    block with an exception, died, or did not reach the same exchange within
    ``NodeOptions.group_timeout``. Every rank's ``step()`` (or block) raises it; restart the
    whole group with the same learner id to rejoin."""
