"""``gradientmail syncer URL``: a syncer-only node that closes rounds until told to stop.

The node has no model (``options.syncer=True``); its events go to stdout as JSON lines
(``gradientmail.events.json_logs``). SIGINT or SIGTERM leaves the node's block normally: its
tasks are cancelled, so a round it was closing is either committed already or left to a
takeover by another syncer, and its lease is deleted. A syncer task that dies
(``SyncerStopped``) ends the command with status 1. ``--trusted-loss MODULE:NAME`` screens
the rounds it closes with that function (``NodeOptions.trusted_loss``), imported from the
current directory or the environment.
"""

import importlib
import os
import re
import signal
import socket
import sys

import anyio

from gradientmail._node import NodeOptions, node
from gradientmail.errors import UsageError
from gradientmail.events import SyncerStopped, json_logs
from gradientmail.protocol.keys import check_learner
from gradientmail.protocol.screening import TrustedLoss

__all__ = ["default_learner", "serve", "syncer", "trusted_loss"]


def default_learner() -> str:
    """``syncer-<host>-<pid>``, with characters a learner id cannot hold replaced by ``-``."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"syncer-{host}-{os.getpid()}"


async def serve(url: str, learner: str, options: NodeOptions | None = None) -> None:
    """Run a syncer-only node on ``url`` until SIGINT or SIGTERM, then close it.

    Raises ``UsageError`` when the node's syncer task died, and whatever joining the run
    raises (``RunMismatch``, ``MailboxUnavailable``, ``ValueError`` for a bad URL).
    Must run in the main thread (it installs signal handlers for its duration).
    """
    stopped: SyncerStopped | None = None
    options = options if options is not None else NodeOptions(syncer=True)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            node(None, url, learner=learner, options=options, sinks=[json_logs(sys.stdout)]) as n,
            anyio.create_task_group() as group,
        ):

            async def until_signal() -> None:
                async for _ in signals:
                    group.cancel_scope.cancel()
                    return

            async def until_failure() -> None:
                nonlocal stopped
                async with n.events() as events:
                    async for event in events:
                        if isinstance(event, SyncerStopped):
                            stopped = event
                            group.cancel_scope.cancel()
                            return

            group.start_soon(until_signal)
            group.start_soon(until_failure)
    if stopped is not None:
        raise UsageError(
            f"the syncer of {learner} stopped: {type(stopped.error).__name__}: {stopped.error}"
        )


def trusted_loss(spec: str) -> TrustedLoss:
    """The function ``MODULE:NAME`` names, imported with the current directory first on the
    path. Raises ``UsageError`` naming what is wrong: the form, a module that does not
    import (with its error), a missing name, or one that is not callable."""
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise UsageError(
            f"--trusted-loss takes MODULE:NAME (a function in an importable module), got {spec!r}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(
            f"--trusted-loss: module {module_name!r} does not import: {type(exc).__name__}: {exc}"
        ) from exc
    found = getattr(module, name, None)
    if found is None or not callable(found):
        what = "has no" if found is None else "has a non-callable"
        raise UsageError(
            f"--trusted-loss: module {module_name!r} {what} {name!r}; name a function from "
            "every parameter's tensors by name to a loss"
        )
    loss: TrustedLoss = found
    return loss


def syncer(url: str, *, learner: str | None, backend: str, trusted: str | None = None) -> int:
    """The ``syncer`` command: exit status 0 after a signal, 1 when the syncer failed;
    ``trusted``: ``--trusted-loss``'s ``MODULE:NAME``."""
    name = learner if learner is not None else default_learner()
    try:
        check_learner(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    loss = trusted_loss(trusted) if trusted is not None else None
    options = NodeOptions(syncer=True, trusted_loss=loss)
    anyio.run(serve, url, name, options, backend=backend)
    return 0
