"""Real processes on a real directory (and once on a moto S3 server), killed with SIGKILL at
the worst moments: a learner mid-training, the claimant of a round right after its claim,
after its first blob and just before its record, and the creator after its first Θ⁰ marker.
The processes a test needs later start with the first ones and wait at a gate, after their
imports, until the test opens it.

Each time the run goes on: another node takes over within the timeouts, every round commits
exactly once, the killed node restarted with the same id rejoins and takes part again, and
nothing committed is lost or damaged (records contiguous, every retained record's blobs
present and matching their hashes, the survivors' steps all accounted for).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from reliability_helpers import FAST, assert_steps_accounted, history

from gradientmail.events import StepsDropped
from gradientmail.mailbox import open as open_mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.checkpoint import retained
from gradientmail.protocol.records import Manifest, decode
from gradientmail.store import Store

WORKER = Path(__file__).with_name("kill_worker.py")
pytestmark = pytest.mark.timeout(240)


class Cluster:
    """The worker processes of one test, all killed and reaped at its end."""

    def __init__(self, url: str, out: Path) -> None:
        self.url = url
        self.out = out
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(WORKER.parent), str(WORKER.parents[1]))),
            "OMP_NUM_THREADS": "1",
        }

    def start(
        self,
        learner: str,
        *,
        role: str = "learner",
        until: str = "0",
        kill: str = "none",
        seed: int = 0,
        backend: str = "asyncio",
        gate: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a worker; with ``gate``, its node waits for ``open(gate)`` after its imports."""
        args = [self.url, learner, str(seed), until, backend, str(self.out), role, kill]
        args += [gate] if gate is not None else []
        process = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.processes.append((learner, process))
        return process

    def killed(self, process: subprocess.Popen[bytes], timeout: float = 90) -> None:
        """Wait for ``process`` to die of its own SIGKILL."""
        _, stderr = process.communicate(timeout=timeout)
        assert process.returncode == -signal.SIGKILL, stderr.decode()[-3000:]

    def finished(self, process: subprocess.Popen[bytes], timeout: float = 150) -> None:
        _, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0, stderr.decode()[-3000:]

    def report(self, learner: str) -> dict[str, Any]:
        return json.loads((self.out / f"{learner}.json").read_text())  # type: ignore[no-any-return]

    def open(self, gate: str) -> None:
        (self.out / gate).touch()

    def stop_syncers(self) -> None:
        (self.out / "stop").touch()

    def close(self) -> None:
        for _, process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            # An unread pipe would be reported as an unclosed file when collected.
            if process.stderr is not None and not process.stderr.closed:
                process.stderr.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    out = tmp_path / "out"
    out.mkdir()
    group = Cluster(str(tmp_path / "run"), out)
    try:
        yield group
    finally:
        group.close()


async def _check_store(url: str) -> list[Any]:
    """Records contiguous and consistent; Θ⁰ and the blobs of every record garbage collection
    retains (``checkpoint.retained``: the checkpoints replays start from) present and
    matching their hashes (``get_blob`` verifies); returns the records."""
    async with open_mailbox(url) as box:
        records = await history(box)
        store = Store(box)
        data = await box.get(keys.MANIFEST)
        assert data is not None
        manifest = decode(data, Manifest)
        config = manifest.config
        refs = list(manifest.theta0)
        kept = retained(records[-1].round, config).records if records else frozenset()
        for record in records:
            if record.round in kept:
                refs += [r for r in (record.theta, record.outer, record.update) if r is not None]
        for ref in refs:
            assert await store.get_blob(ref) is not None, f"blob {ref.sha256[:12]} is gone"
        return records


def check_store(url: str) -> list[Any]:
    return anyio.run(_check_store, url)


def _accounted(cluster: Cluster, learner: str, records: list[Any]) -> None:
    report = cluster.report(learner)
    drops = [
        StepsDropped(learner, d["fragment"], d["steps"], d["tokens"], "") for d in report["drops"]
    ]
    assert_steps_accounted(learner, report["steps"], report["tokens"], drops, records)


def _claims(url: str) -> dict[int, list[str]]:
    async def read() -> dict[int, list[str]]:
        async with open_mailbox(url) as box:
            found: dict[int, list[str]] = {}
            for key in await box.list(keys.ROUNDS):
                parsed = keys.parse_claim(key)
                data = await box.get(key)
                if parsed is not None and data is not None:
                    found.setdefault(parsed[0], []).append(json.loads(data)["learner"])
            return found

    return anyio.run(read)


def test_a_learner_killed_mid_training_rejoins_and_resumes(cluster: Cluster) -> None:
    # The victim trains until it is killed, however late it joins: once a record counts it,
    # so that its first life has work in the run on the slowest machine (started last, it
    # could otherwise die before its first round closes, after the others had finished).
    a = cluster.start("a", until="14", seed=1)
    b = cluster.start("b", until="14", seed=2, backend="trio")
    victim = cluster.start("c", until="+1000", seed=3, kill="counted:20")
    again = cluster.start("c", until="+6", seed=3, backend="trio", gate="again")
    cluster.killed(victim)
    cluster.open("again")
    for process in (a, b, again):
        cluster.finished(process)
    records = check_store(cluster.url)
    # It rejoins from a committed record (-1: from Θ⁰ alone); the record that counted its
    # first life may be round 0 when it was killed at once.
    rejoined = cluster.report("c")["joined"]
    assert rejoined >= 0
    assert any(p.learner == "c" for r in records if r.round > rejoined for p in r.participants)
    assert any(p.learner == "c" for r in records if r.round <= rejoined for p in r.participants)
    for learner in ("a", "b"):
        _accounted(cluster, learner, records)
    _commits_once(cluster, records, ("a", "b", "c"))


def _commits_once(cluster: Cluster, records: list[Any], reporters: tuple[str, ...]) -> None:
    """No two reporting processes committed the same round, and each round's record names
    its committer."""
    seen: dict[int, str] = {}
    for learner in reporters:
        for round in cluster.report(learner)["committed"]:
            assert round not in seen, f"round {round} committed by {seen[round]} and {learner}"
            seen[round] = learner
            assert records[round].committed_by == learner


def test_claimants_killed_while_closing_are_taken_over(cluster: Cluster) -> None:
    """Three syncer-only claimants die at their first claim: one right after claiming, one
    after its first blob, one just before its record; each takes over from the one before.
    A late syncer takes over the round they left as soon as their leases are gone; then one
    of them, restarted with its id, rejoins and closes rounds again."""
    learners = [
        cluster.start("l1", role="learner-only", until="10", seed=1),
        cluster.start("l2", role="learner-only", until="10", seed=2, backend="trio"),
    ]
    victims = {
        point: cluster.start(f"k-{point}", role="syncer", kill=point, backend=backend)
        for point, backend in (("claim", "asyncio"), ("blob", "trio"), ("record", "asyncio"))
    }
    survivor = cluster.start("s", role="syncer", backend="trio", gate="survivor")
    # One of them is enough to show a restarted claimant rejoins (the other kill tests
    # restart theirs too).
    again = cluster.start("k-record", role="syncer", gate="again")
    for process in victims.values():
        cluster.killed(process)
    claims = _claims(cluster.url)
    names = {f"k-{point}" for point in victims}
    assert {claimant for found in claims.values() for claimant in found} == names
    stuck = max(claims)
    cluster.open("survivor")
    _wait_for_record(cluster.url, stuck, limit=60)
    cluster.open("again")
    for process in learners:
        cluster.finished(process)
    cluster.stop_syncers()
    for process in (survivor, again):
        cluster.finished(process)
    records = check_store(cluster.url)
    assert len(records) >= 11
    assert records[stuck].committed_by == "s"
    taken = [t for t in cluster.report("s")["took_over"] if t["round"] == stuck]
    assert taken == [{"round": stuck, "cause": "lease_gone"}]
    # A lease it has just met is trusted for one lease timeout, then it takes over.
    (after,) = [
        seconds
        for seconds, t in zip(
            cluster.report("s")["took_over_after"], cluster.report("s")["took_over"], strict=True
        )
        if t["round"] == stuck
    ]
    assert after < FAST.lease_timeout + FAST.claim_timeout
    assert cluster.report("k-record")["recovered"], "k-record did not rejoin"
    for learner in ("l1", "l2"):
        _accounted(cluster, learner, records)
    _commits_once(cluster, records, ("s", "k-record"))


def _wait_for_record(url: str, round: int, limit: float) -> None:
    async def wait() -> None:
        async with open_mailbox(url) as box:
            with anyio.fail_after(limit):
                # Another process writes it: nothing to wait on but the store.
                while await box.get(keys.record(round)) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.05)

    anyio.run(wait)


def test_the_creator_killed_after_its_first_marker_is_taken_over(cluster: Cluster) -> None:
    victim = cluster.start("v", until="10", seed=1, kill="init:1")
    joiners = [
        cluster.start("j1", until="10", seed=2, gate="joiners"),
        cluster.start("j2", until="10", seed=3, backend="trio", gate="joiners"),
    ]
    again = cluster.start("v", until="+4", seed=1, gate="again")
    cluster.killed(victim)
    cluster.open("joiners")
    for process in joiners:
        cluster.finished(process)
    cluster.open("again")
    cluster.finished(again)
    records = check_store(cluster.url)
    creator = cluster.report("j1")["created_by"]
    assert creator in {"j1", "j2"}
    assert cluster.report(creator)["took_over_creation"]
    assert cluster.report("v")["created_by"] == creator
    assert any(p.learner == "v" for r in records for p in r.participants)
    for learner in ("j1", "j2"):
        _accounted(cluster, learner, records)


def test_a_claimant_killed_before_its_record_on_s3(
    tmp_path: Path, moto_server: str, s3_bucket: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    url = f"s3://{s3_bucket}/run?endpoint_url={moto_server}&region=us-east-1"
    cluster = Cluster(url, out)
    try:
        learner = cluster.start("l1", role="learner-only", until="6", seed=1)
        victim = cluster.start("k", role="syncer", kill="record", backend="trio")
        survivor = cluster.start("s", role="syncer", gate="survivor")
        cluster.killed(victim)
        stuck = max(_claims(url))
        cluster.open("survivor")
        cluster.finished(learner)
        cluster.stop_syncers()
        cluster.finished(survivor)
        records = check_store(url)
        assert records[stuck].committed_by == "s"
        assert {"round": stuck, "cause": "lease_gone"} in cluster.report("s")["took_over"]
        _accounted(cluster, "l1", records)
    finally:
        cluster.close()
