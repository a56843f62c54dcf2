"""Development sessions: ``lint``, ``types``, ``tests``, ``report``, ``ceph`` (the default),
``soak``, ``bench``, ``bench-text``, ``bench-large``.

The sessions run in the environment nox itself runs in, which the README's command creates
once (``.venv`` with the ``dev`` extra, whose torch pin is the CPU wheel): installing torch
into a fresh virtual environment per session would cost minutes each time.
"""

import sys

import nox

nox.options.sessions = ["lint", "types", "tests", "report", "ceph"]
nox.options.default_venv_backend = "none"

PYTHON = sys.executable
SOURCES = ["gradientmail", "tests", "benchmarks", "docs/examples", "noxfile.py"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (both event loops, every mailbox backend) in two passes, each on three
    xdist workers on CI's two cores: about a third of the suite's time is waiting (learners'
    simulated compute, graces, processes starting), which a third worker fills. The tests
    marked ``timing`` (who makes a round within its grace) run first, among themselves: they
    mostly sleep, and a core taken by a CPU-bound neighbour can hold a learner past its
    grace. A worker out of tests takes another's last ones (``worksteal``), so a slow test
    near the end leaves no core idle. ``nox -s tests -- -n 0`` runs each pass in one
    process."""
    for marks in ("timing", "not timing"):
        session.run(
            PYTHON,
            "-m",
            "pytest",
            "-q",
            "-n",
            "3",
            "--dist",
            "worksteal",
            "-m",
            f"({marks}) and not browser and not ceph",
            *session.posargs,
        )


@nox.session
def report(session: nox.Session) -> None:
    """The report's page opened in headless Chromium (``tests/cli/test_report_browser.py``,
    marked ``browser``, which ``tests`` leaves out), Debian's package installed first by
    ``.ci/chromium`` when missing (about 2 minutes from a Debian mirror; the tests take
    about 15 s)."""
    session.run("bash", ".ci/chromium", external=True)
    session.run(
        PYTHON,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:xdist",
        "-m",
        "browser",
        "tests/cli",
        *session.posargs,
    )


@nox.session
def ceph(session: nox.Session) -> None:
    """The S3 tests marked ``ceph`` (the mailbox contract suite and the conditional requests
    of large objects, both event loops; ``tests`` leaves them out) against a throwaway
    single-node Ceph cluster's RADOS Gateway that the tests start and remove
    (``tests/ceph_cluster.py``), Debian's packages installed first by ``.ci/ceph`` when
    missing."""
    session.run("bash", ".ci/ceph", external=True)
    session.run(
        PYTHON,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:xdist",
        "-m",
        "ceph",
        "tests/mailbox/test_mailbox_contract.py",
        "tests/mailbox/test_mailbox_s3_parts.py",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff's lint rules and formatting."""
    session.run(PYTHON, "-m", "ruff", "check", *SOURCES)
    session.run(PYTHON, "-m", "ruff", "format", "--check", *SOURCES)


@nox.session
def types(session: nox.Session) -> None:
    """mypy, strict, on the package."""
    session.run(PYTHON, "-m", "mypy")


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """The long soaks: four nodes, 200 rounds, ~6% of store operations faulted
    (``tests/reliability/test_soak.py``), and 120 rounds of the chaos writer with collection
    live (``test_chaos_gc.py``); a plain and a signed run of each, both event loops."""
    session.run(
        PYTHON,
        "-m",
        "pytest",
        "-q",
        "-s",
        "tests/reliability/test_soak.py",
        "tests/reliability/test_chaos_gc.py",
        "-k",
        "full",
        *session.posargs,
        env={"GRADIENTMAIL_SOAK": "1"},
    )


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark, then ``docs/benchmarks.md`` generated from ``benchmarks/results``;
    ``nox -s bench -- --quick`` for the smoke-test sizes."""
    session.run(PYTHON, "benchmarks/run.py", *session.posargs)


@nox.session(name="bench-large", default=False)
def bench_large(session: nox.Session) -> None:
    """The large points, one at a time (about 30 minutes; moto keeps objects in memory and a
    250M-parameter round takes about 12 GB): a 1 GiB blob through both mailboxes with the
    part-size sweep, peak memory at 25M, 100M and 250M parameters and the round latency of a
    250M-parameter fragment across processes, a joiner of a 1 GiB run; then
    ``docs/benchmarks.md``."""
    session.run(PYTHON, "benchmarks/bench_transfer.py", "--large", "--sweep", *session.posargs)
    session.run(PYTHON, "benchmarks/bench_memory.py", "--large", *session.posargs)
    session.run(PYTHON, "benchmarks/bench_rejoin.py", "--large", *session.posargs)
    session.run(PYTHON, "benchmarks/report.py")


@nox.session(name="bench-text", default=False)
def bench_text(session: nox.Session) -> None:
    """The real-text benchmark against torchft's DiLoCo (needs the ``bench`` extra), then
    ``docs/benchmarks.md``; ``nox -s bench-text -- --size small`` for the scaled-down run,
    ``-- --only dp gm-fp32-H100 torchft-fp32-H100`` for some arms (with ``--keep`` the
    results file keeps the stored runs of the others: a full run in parts), ``-- --size medium
    --mode defaults`` (the defaults over three seeds), ``--mode repeat`` (two learners,
    plain SGD, five seeds), ``--mode rerun`` (the same, one seed five times: only the
    timing differs) or ``--mode timing`` (each fp32 pair in both orders: the wall target's
    measure)."""
    session.run(PYTHON, "benchmarks/bench_text.py", *session.posargs)
    session.run(PYTHON, "benchmarks/report.py")
