"""``CliError``: a failure the user can act on (kept apart so parsing imports nothing heavy)."""

__all__ = ["CliError"]


class CliError(Exception):
    """A failure the user can fix; its message says what was wrong and what to do.

    ``main`` prints it and exits with status 1, without a traceback unless ``--debug``.
    """
