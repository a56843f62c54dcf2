"""``gradientmail syncer URL``: a syncer-only node that closes rounds until told to stop.

The node has no model (``options.syncer=True``); its events go to stdout as JSON lines
(``gradientmail.events.json_logs``). SIGINT or SIGTERM leaves the node's block normally: its
tasks are cancelled, so a round it was closing is either committed already or left to a
takeover by another syncer, and its lease is deleted. A syncer task that dies
(``SyncerStopped``) ends the command with status 1.
"""

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

__all__ = ["default_learner", "serve", "syncer"]


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


def syncer(url: str, *, learner: str | None, backend: str) -> int:
    """The ``syncer`` command: exit status 0 after a signal, 1 when the syncer failed."""
    name = learner if learner is not None else default_learner()
    try:
        check_learner(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    anyio.run(serve, url, name, backend=backend)
    return 0
