"""Opening the store a command names, with the user's mistakes turned into ``CliError``."""

import contextlib
from collections.abc import AsyncIterator

import anyio

from gradientmail import mailbox as mailboxes
from gradientmail.cli._errors import CliError
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.local import LocalMailbox

__all__ = ["CliError", "open_store"]


@contextlib.asynccontextmanager
async def open_store(url: str, *, must_exist: bool) -> AsyncIterator[Mailbox]:
    """Open the mailbox ``url`` names (``gradientmail.mailbox.open``) for the block.

    With ``must_exist``, a local directory that is not there is a ``CliError`` rather than
    being created by entering the mailbox, so reading commands never leave an empty store
    behind. A URL the opener refuses (``ValueError``) is a ``CliError`` naming it.
    """
    try:
        store = mailboxes.open(url)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if (
        must_exist
        and isinstance(store, LocalMailbox)
        and not await anyio.Path(store.directory).is_dir()
    ):
        raise CliError(f"{url}: no such directory, so no run there")
    async with store:
        yield store
