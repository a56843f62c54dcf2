"""The public surface, pinned: a name added to or removed from ``gradientmail`` or
``gradientmail.sync`` fails here until this list, the docs and the changelog say so."""

import inspect

import gradientmail
import gradientmail.sync

PUBLIC = {
    "AdmissionKey",
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
    # Before hasattr imports them, the names gradientmail imports on first use are listed.
    assert set(dir(gradientmail)) >= PUBLIC
    assert set(gradientmail.__all__) == PUBLIC
    assert set(gradientmail.sync.__all__) == SYNC
    for module, names in ((gradientmail, PUBLIC), (gradientmail.sync, SYNC)):
        missing = [name for name in names if not hasattr(module, name)]
        assert not missing, missing


def test_the_entry_points_take_the_pinned_arguments() -> None:
    """``gradientmail.node``, ``sync.node`` and ``sync.open`` take the model and the mailbox,
    then the same keywords (the sync ones also ``backend`` and ``handle_signals``): one
    renamed or dropped fails here."""
    keywords = {"learner", "config", "options", "sinks", "clock", "run_key", "group"}
    sync_keywords = keywords | {"backend", "handle_signals"}
    for function, expected in (
        (gradientmail.node, keywords),
        (gradientmail.sync.node, sync_keywords),
        (gradientmail.sync.open, sync_keywords),
    ):
        parameters = inspect.signature(function).parameters.values()
        positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == ["model", "mailbox"], function
        assert {p.name for p in parameters if p.kind is p.KEYWORD_ONLY} == expected, function
