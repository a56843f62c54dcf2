"""What a node's block raises when its task group fails: one exception, never an
``ExceptionGroup`` of one, and the user's own before the node's ``NodeFailed``."""

from collections.abc import Iterator

from gradientmail.errors import NodeFailed

__all__ = ["block_error"]


def block_error(group: ExceptionGroup[Exception]) -> BaseException:
    """The exception a node's block raises for what its task group raised: the body's own
    exception if it raised one (the group, if its code raised several at once), else the
    node's ``NodeFailed``."""
    leaves = list(_leaves(group))
    mine = [e for e in leaves if not isinstance(e, NodeFailed)]
    failed = [e for e in leaves if isinstance(e, NodeFailed)]
    if mine:
        return mine[0] if len(mine) == 1 else group
    return failed[0]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
