"""Development sessions: ``nox -s tests``, ``lint``, ``types`` (and later ``demo``, ``bench``).

Every session installs the project with its ``dev`` extra, which pins torch to the CPU wheel.
"""

import nox

nox.options.sessions = ["tests", "lint", "types"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("ruff", "check", "gradientmail", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "gradientmail", "tests", "benchmarks", "noxfile.py")


@nox.session(python="3.11")
def types(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("mypy")
