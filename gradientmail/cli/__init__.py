"""The ``gradientmail`` command line: ``demo``, ``status``, ``syncer`` and ``export``.

``main(argv)`` parses and runs one command and returns its exit status (0 success, 1 the run
or store is not usable, 2 usage); the ``gradientmail`` console script and
``python -m gradientmail`` call it. See ``docs/cli.md``.
"""

from gradientmail.cli._app import main, parser

__all__ = ["main", "parser"]
