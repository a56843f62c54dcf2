"""shared_queue and Barrier across real processes on one LocalMailbox directory, with consumers
under asyncio and trio side by side, and a real SIGKILL of one of them mid-unit. (The
processes are forked from a server that imported gradientmail once: ``forked``.)"""

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import msgspec
from forked import Forked

WORKER = Path(__file__).with_name("_queue_worker.py")
UNITS = 200
TIMEOUT = 60.0


def start(store: Path, learner: str, out: Path, backend: str, *extra: str) -> Forked:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    arguments = [str(store), learner, "--units", str(UNITS), "--out", str(out)]
    arguments += ["--backend", backend, *extra]
    return Forked(WORKER, arguments, env, out.with_name(out.name + ".log"))


def finish(process: Forked) -> None:
    try:
        process.wait(TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, process.read()


def lines(out: Path) -> list[tuple[str, int]]:
    if not out.exists():
        return []
    return [(unit, int(k)) for unit, k in (line.split() for line in out.read_text().splitlines())]


def wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def every_unit() -> set[str]:
    return {f"u{i:03d}" for i in range(UNITS)}


def test_four_processes_take_every_unit_exactly_once(tmp_path: Path) -> None:
    store = tmp_path / "store"
    learners = [f"node-{n}" for n in range(4)]
    processes = [
        start(
            store,
            learner,
            tmp_path / f"{learner}.out",
            ("asyncio", "trio")[n % 2],
            "--start-parties",
            "4",
            "--done-parties",
            "4",
        )
        for n, learner in enumerate(learners)
    ]
    for process in processes:
        finish(process)

    consumed = Counter(item for learner in learners for item in lines(tmp_path / f"{learner}.out"))
    assert consumed == Counter((unit, k) for unit in every_unit() for k in (0, 1))
    reports = {
        learner: json.loads((tmp_path / f"{learner}.out.done").read_text()) for learner in learners
    }
    claimed = [unit for report in reports.values() for unit in report["claimed"]]
    assert sorted(claimed) == sorted(every_unit())
    for learner, report in reports.items():
        assert {unit for unit, _ in lines(tmp_path / f"{learner}.out")} == set(report["claimed"])
        assert report["met"] == learners


def test_a_consumer_killed_mid_unit_leaves_it_claimed_and_the_others_finish(tmp_path: Path) -> None:
    store = tmp_path / "store"
    victim_out = tmp_path / "victim.out"
    victim = start(store, "victim", victim_out, "trio", "--start-parties", "4", "--hang-at", "2")
    others = [f"node-{n}" for n in range(3)]
    processes = [
        start(
            store,
            learner,
            tmp_path / f"{learner}.out",
            ("asyncio", "trio")[n % 2],
            "--start-parties",
            "4",
            "--done-parties",
            "3",
            "--delay",
            "0.005",
        )
        for n, learner in enumerate(others)
    ]
    try:
        hang = victim_out.with_name("victim.out.hang")
        wait_for(hang.exists, "the victim to hang in its second unit")
        stuck = hang.read_text()
        wait_for(
            lambda: (stuck, 0) in lines(victim_out), "the victim to consume the unit's first item"
        )
        assert victim.poll() is None
        victim.send_signal(signal.SIGKILL)
        victim.wait(TIMEOUT)
        assert victim.returncode == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
    for process in processes:
        finish(process)

    by_others = Counter(item for learner in others for item in lines(tmp_path / f"{learner}.out"))
    by_victim = Counter(lines(victim_out))
    # The victim finished its first unit and consumed one item of its second.
    assert len({unit for unit, _ in by_victim}) == 2
    assert by_victim[(stuck, 0)] == 1
    assert (stuck, 1) not in by_victim
    assert by_others + by_victim == Counter(
        [(unit, k) for unit in every_unit() - {stuck} for k in (0, 1)] + [(stuck, 0)]
    )
    # The stuck unit stays claimed by the dead node: nobody else took it.
    assert not any(unit == stuck for unit, _ in by_others)
    body = (store / "objects" / "units" / f"{stuck}%").read_bytes()
    assert msgspec.json.decode(body)["learner"] == "victim"
    for learner in others:
        report = json.loads((tmp_path / f"{learner}.out.done").read_text())
        assert report["met"] == others
