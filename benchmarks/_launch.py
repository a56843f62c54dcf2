"""A benchmark's worker processes: started, killed and restarted on cue, and waited for.

``launch`` runs one run's learner processes and its services (a dedicated syncer, unless a
learner hosts it) as ``script --worker SPEC ROLE``, each writing its report to
``result-{role}.json`` in the run's scratch directory; ``StoragePeak`` samples the size of
the run's store meanwhile. Everything here runs in the runner's process, on its main thread
(``StoragePeak`` samples on a thread of its own).
"""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 10 ms; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout} s")
        time.sleep(0.01)


@dataclass(frozen=True)
class Kill:
    """SIGKILL learner ``index`` once it has done ``at_step`` steps, and start it again
    ``restart_after`` seconds later (it resumes at the step its progress file names)."""

    index: int
    at_step: int
    restart_after: float


class _Processes:
    """The processes of one launch, each ``script --worker SPEC ROLE`` with one thread for
    torch (``OMP_NUM_THREADS=1``), its output appended to ``log-{role}.txt``."""

    def __init__(self, script: Path, scratch: Path, spec_path: Path) -> None:
        self._script = script
        self._scratch = scratch
        self._spec_path = spec_path
        self._env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._logs: list[BinaryIO] = []
        self._started: list[subprocess.Popen[bytes]] = []

    def spawn(self, role: str, stdin: int | None = None) -> subprocess.Popen[bytes]:
        log = open(self._scratch / f"log-{role}.txt", "ab")  # noqa: SIM115 (closed by close)
        self._logs.append(log)
        process = subprocess.Popen(
            [sys.executable, str(self._script), "--worker", str(self._spec_path), role],
            env=self._env,
            stdin=stdin,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self._started.append(process)
        return process

    def failed(self, role: str) -> RuntimeError:
        """The error for ``role``'s failure, with the end of its log."""
        log = (self._scratch / f"log-{role}.txt").read_text(errors="replace")
        return RuntimeError(f"{role} failed:\n{log[-4000:]}")

    def report(self, role: str) -> Path:
        """Where ``role`` writes its report (once its work is done)."""
        return self._scratch / f"result-{role}.json"

    def close(self) -> None:
        """Kill every process still running and close the logs."""
        for process in self._started:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in self._logs:
            log.close()


def _kill_and_restart(
    processes: _Processes,
    learners: dict[str, subprocess.Popen[bytes]],
    kill: Kill,
    scratch: Path,
    timeout: float,
) -> dict[str, float]:
    """Carry out ``kill`` on ``learners`` (the restarted process replaces the killed one);
    the ``time.monotonic()`` of the kill and of the restart."""
    victim, progress = str(kill.index), scratch / f"progress-{kill.index}"

    def reached() -> bool:
        if learners[victim].poll() is not None:
            raise processes.failed(victim)
        return progress.exists() and int(progress.read_text() or 0) >= kill.at_step

    wait_for(reached, timeout, f"learner {victim} to reach step {kill.at_step}")
    learners[victim].kill()
    learners[victim].wait()
    killed = time.monotonic()
    time.sleep(kill.restart_after)
    learners[victim] = processes.spawn(victim)
    return {"killed": killed, "restarted": time.monotonic()}


def _wait_all(
    processes: _Processes,
    learners: dict[str, subprocess.Popen[bytes]],
    services: dict[str, subprocess.Popen[bytes]],
    timeout: float,
) -> None:
    """Wait until every learner that reads no standard input has written its report (its
    node closed: its work is done) or exited, then close the standard input of the others
    and of the services, and wait for every process; ``RuntimeError``
    (``_Processes.failed``) for the first that exits with an error. The standard inputs
    close on the reports, not on the exits, so that a process hosting the syncer tears down
    beside the others, as every process of a peer system does: an interpreter with torch
    loaded takes seconds to exit, and waiting for the others' exits first put one more such
    exit into every run's wall time."""
    stopped = services | {role: p for role, p in learners.items() if p.stdin is not None}
    working = {role: p for role, p in learners.items() if role not in stopped}

    def finished() -> bool:
        done = True
        for role, process in working.items():
            code = process.poll()
            if code not in (None, 0):
                raise processes.failed(role)
            done = done and (code == 0 or processes.report(role).exists())
        return done

    wait_for(finished, timeout, "every learner's report")
    for process in stopped.values():
        assert process.stdin is not None
        process.stdin.close()
    for role, process in {**working, **stopped}.items():
        limit = timeout if role in learners else 120
        if process.wait(timeout=limit) != 0:
            raise processes.failed(role)


def launch(
    script: Path,
    spec: dict[str, Any],
    *,
    services: tuple[str, ...] = ("syncer",),
    kill: Kill | None = None,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Write ``spec`` to ``spec["scratch"]/spec.json`` and run ``spec["learners"]`` learner
    processes (roles ``0`` …) and the ``services`` (e.g. a dedicated syncer) as
    ``script --worker SPEC ROLE``; once every other learner has exited, close the standard
    input of the services and of the learner ``spec["syncer_in"]`` (which hosts the syncer
    instead: ``_workers.learner_worker``), their signal to stop, and wait for them. With
    ``kill``, one learner is SIGKILLed and restarted as described. Returns every role's
    report (``result-{role}.json``; a hosted syncer's as ``syncer``), the wall time, and the
    ``time.monotonic()`` of the start and, for a kill, of the kill and the restart.
    ``RuntimeError`` with the end of its log for a process that fails; ``ValueError`` when
    ``kill`` names the learner that hosts the syncer. ``timeout`` (per process) only catches
    a hang: on a machine half as fast as the one the full sizes were measured on, a full
    real-text arm takes about 16 minutes."""
    host = spec.get("syncer_in")
    if kill is not None and kill.index == host:
        raise ValueError(f"learner {host} runs the syncer: kill another learner")
    scratch = Path(spec["scratch"])
    scratch.mkdir(parents=True)
    spec_path = scratch / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    processes = _Processes(script, scratch, spec_path)
    started = time.perf_counter()
    events: dict[str, float] = {"started": time.monotonic()}
    storage = StoragePeak(scratch / "store")
    learners = {
        str(k): processes.spawn(str(k), subprocess.PIPE if k == host else None)
        for k in range(spec["learners"])
    }
    others = {role: processes.spawn(role, subprocess.PIPE) for role in services}
    try:
        if kill is not None:
            events |= _kill_and_restart(processes, learners, kill, scratch, timeout)
        _wait_all(processes, learners, others, timeout)
    finally:
        storage.stop()
        processes.close()
    wall = time.perf_counter() - started
    reports = {
        role: json.loads(processes.report(role).read_text()) for role in (*learners, *others)
    }
    if host is not None:
        reports["syncer"] = reports[str(host)].pop("syncer")
    return {
        "reports": reports,
        "wall_seconds": wall,
        "events": events,
        "peak_store_bytes": storage.peak,
    }


class StoragePeak:
    """The largest total size of the files under ``root`` (the run's ``LocalMailbox``
    directory) seen by a thread sampling it every 0.1 s until ``stop``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        total = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    continue
        return total

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.peak = max(self.peak, self._size())

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._size())
