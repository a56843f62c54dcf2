"""The public surface, pinned: a name added to or removed from ``gradientmail`` or
``gradientmail.sync`` fails here until this list, the docs and the changelog say so."""

import gradientmail
import gradientmail.sync

PUBLIC = {
    "Barrier",
    "CorruptBlob",
    "GradientmailError",
    "GroupFailed",
    "LearnerKey",
    "MailboxUnavailable",
    "NoRun",
    "Node",
    "NodeFailed",
    "NodeOptions",
    "NodeState",
    "RecordError",
    "RunConfig",
    "RunMismatch",
    "StepHandle",
    "StoreAccessError",
    "StoreTampered",
    "admit",
    "events",
    "load",
    "node",
    "preview",
    "revoke",
    "shared_queue",
    "sync",
}
SYNC = {"Backend", "Barrier", "Events", "Node", "Terminated", "load", "node", "open"}


def test_the_public_names_are_the_pinned_ones_and_all_exist() -> None:
    assert set(gradientmail.__all__) == PUBLIC
    assert set(gradientmail.sync.__all__) == SYNC
    for module, names in ((gradientmail, PUBLIC), (gradientmail.sync, SYNC)):
        missing = [name for name in names if not hasattr(module, name)]
        assert not missing, missing
