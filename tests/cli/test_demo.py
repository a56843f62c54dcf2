"""``gradientmail demo`` end to end: real learner processes on a real directory, then the
reading commands on the store it leaves, and Ctrl-C followed by a resume."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest
import safetensors.torch
import torch
from cli_helpers import cli
from rich.console import Console

from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.demo.runner import _check_run, _Session
from gradientmail.demo.settings import DemoSettings
from gradientmail.errors import UsageError
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.codec import decode_fragment
from gradientmail.protocol.fragments import window
from gradientmail.protocol.outer import apply_update
from gradientmail.protocol.records import Manifest, RoundRecord, decode

TINY = (
    "--learners", "2", "--model", "tiny", "--fragments", "2", "--sync-every", "8",
    "--batch-size", "4", "--context", "16", "--eval-every", "1", "--no-live",
)  # fmt: skip


@dataclass(frozen=True)
class StoreContent:
    manifest: Manifest
    records: dict[int, RoundRecord]
    leases: list[str]
    blobs: dict[str, bytes]


async def _read(directory: Path) -> StoreContent:
    async with LocalMailbox(directory) as mailbox:
        data = await mailbox.get(keys.MANIFEST)
        assert data is not None
        manifest = decode(data, Manifest)
        records = {}
        for key in await mailbox.list(keys.RECORDS):
            round = keys.parse_record(key)
            body = await mailbox.get(key)
            assert round is not None
            assert body is not None
            records[round] = decode(body, RoundRecord)
        blobs = {}
        for key in await mailbox.list(keys.BLOBS):
            body = await mailbox.get(key)
            if body is not None:
                blobs[key.removeprefix(keys.BLOBS)] = body
        leases = list(await mailbox.list(keys.LEASES))
    return StoreContent(manifest, records, leases, blobs)


def read_store(directory: Path) -> StoreContent:
    return anyio.run(_read, directory)


def replayed_theta(content: StoreContent, round: int) -> list[torch.Tensor]:
    """θ of the version ``round`` made, from the stored bytes by hand: the newest record of
    its fragment at or before it that carries θ (else Θ⁰), and the updates after it."""
    record = content.records[round]
    spec = content.manifest.fragments[record.fragment]
    count = len(content.manifest.fragments)
    ours = [r for r in sorted(content.records) if r % count == record.fragment and r <= round]
    with_theta = [r for r in ours if content.records[r].theta is not None]
    start = with_theta[-1] if with_theta else -1
    ref = content.records[start].theta if start >= 0 else content.manifest.theta0[spec.index]
    assert ref is not None
    theta = decode_fragment(content.blobs[ref.sha256], spec)
    for r in ours:
        if r > start:
            theta = apply_update(theta, content.blobs[content.records[r].update.sha256], spec)
    return theta


def _wait_for(condition: Callable[[], bool], what: str, deadline: float) -> None:
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass(frozen=True)
class Interrupted:
    """What the interrupted session left: the runner's exit status and output, the learners'
    pids, their exit statuses as the runner saw them (``summary.json``), the phase each
    reported last, and the store."""

    returncode: int | None
    output: str
    pids: list[int]
    exit_codes: dict[str, int | None]
    phases: list[str]
    content: StoreContent


@dataclass(frozen=True)
class DemoRun:
    store: Path
    interrupted: Interrupted
    resumed: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """A demo interrupted by SIGINT once two rounds committed, then resumed to the end:
    two real sessions of two learner processes on one directory."""
    store = tmp_path_factory.mktemp("demo") / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    progress = [store / "progress" / f"learner-{i}.json" for i in range(2)]

    def training() -> bool:
        records = store / "objects" / "records"
        if not records.is_dir() or len(list(records.iterdir())) < 2:
            return False
        return all(path.exists() and json.loads(path.read_text())["step"] > 0 for path in progress)

    with subprocess.Popen(
        [sys.executable, "-m", "gradientmail", "demo", "--store", str(store),
         "--steps", "100000", *TINY],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    ) as demo:  # fmt: skip
        try:
            _wait_for(training, "both learners training and two committed rounds", 180)
            pids = [json.loads(path.read_text())["pid"] for path in progress]
            demo.send_signal(signal.SIGINT)
            # The deadlines only stop a hang: whether each learner stopped on its own within
            # the runner's grace is read from its exit status, not from a clock.
            output, _ = demo.communicate(timeout=180)
        finally:
            if demo.poll() is None:
                demo.kill()
    summary = json.loads((store / "summary.json").read_text())
    phases = [json.loads(path.read_text())["phase"] for path in progress]
    interrupted = Interrupted(
        demo.returncode, output, pids, summary["exit_codes"], phases, read_store(store)
    )
    resumed = cli("demo", "--store", str(store), "--steps", "8", *TINY, timeout=240)
    return DemoRun(store, interrupted, resumed)


def test_ctrl_c_stops_every_process_cleanly(demo_run: DemoRun) -> None:
    store, stop = demo_run.store, demo_run.interrupted
    assert stop.returncode == 130, stop.output
    # Every learner stopped by itself within the runner's grace (one still running when the
    # grace ends is killed: exit status -9, and it never reports ``interrupted``).
    assert stop.exit_codes == {"learner-0": 0, "learner-1": 0}, stop.output
    assert stop.phases == ["interrupted", "interrupted"]
    assert "Traceback" not in stop.output
    # The console wraps lines at spaces, wherever the path's length puts them.
    assert f"gradientmail demo --store {store}` resumes it" in " ".join(stop.output.split())
    for pid in stop.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert stop.content.leases == [], "an interrupted learner releases its lease"
    assert sorted(stop.content.records) == list(range(len(stop.content.records)))


def test_the_interrupted_run_resumes_and_completes(demo_run: DemoRun) -> None:
    store, before = demo_run.store, demo_run.interrupted.content
    result = demo_run.resumed
    assert result.returncode == 0, result.stdout + result.stderr
    for i in range(2):
        assert "Traceback" not in (store / "logs" / f"learner-{i}.log").read_text()
    after = read_store(store)
    assert after.manifest == before.manifest
    assert len(after.records) > len(before.records)
    assert sorted(after.records) == list(range(len(after.records)))
    summary = json.loads((store / "summary.json").read_text())
    assert summary["session"] == 1
    assert summary["interrupted"] is False


def test_a_demo_completes_and_its_outputs_parse(demo_run: DemoRun) -> None:
    store, stdout = demo_run.store, demo_run.resumed.stdout
    assert "entropy floor (exact)" in stdout
    assert f"plot of eval loss against tokens: {store / 'eval-loss.png'}" in stdout
    assert (store / "eval-loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((store / "summary.json").read_text())
    content = read_store(store)
    assert summary["rounds"] == len(content.records) >= 4
    assert set(summary["learners"]) == {"learner-0", "learner-1"}
    for progress in summary["learners"].values():
        assert progress["phase"] == "done"
        assert progress["step"] == 8
        assert progress["tokens"] == 8 * 4 * 16
        assert progress["state"]["bytes_published"] > 0
        assert progress["state"]["bytes_downloaded"] > 0
    loss = summary["loss"]
    assert loss["final"] < loss["start"]
    assert 0 < loss["floor"] < loss["unigram"] < loss["start"]
    history = [json.loads(line) for line in (store / "eval.jsonl").read_text().splitlines()]
    assert history[0]["round"] == -1
    assert history[0]["tokens"] == 0
    assert history[-1]["round"] == max(content.records)
    assert history[-1]["loss"] == loss["final"]
    tokens = [point["tokens"] for point in history]
    assert tokens == sorted(tokens)
    kinds = set()
    for name in ("learner-0", "learner-1"):
        for line in (store / "events" / f"{name}.jsonl").read_text().splitlines():
            event = json.loads(line)
            assert event["learner"] == name
            kinds.add(event["event"])
    assert {"joined", "snapshot_published", "round_committed", "closed"} <= kinds
    assert content.leases == [], "every learner releases its lease at the end"


def test_status_json_matches_the_store(demo_run: DemoRun) -> None:
    store = demo_run.store
    result = cli("status", str(store), "--json", "--last", "100")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    content = read_store(store)
    assert doc["manifest"]["created_by"] == content.manifest.created_by
    assert doc["totals"]["rounds"] == len(content.records)
    assert [r["round"] for r in doc["rounds"]] == sorted(content.records)
    # A finished run (every learner released its lease) says so; each round carries the
    # closer's wall-clock time, in commit order.
    assert doc["finished"] is True
    stamps = [r["closed_at"] for r in doc["rounds"]]
    assert stamps == sorted(stamps)
    assert time.time() - 3600 < stamps[0] <= stamps[-1] <= time.time()
    for shown in doc["rounds"]:
        record = content.records[shown["round"]]
        assert shown["committed_by"] == record.committed_by
        assert [p["learner"] for p in shown["participants"]] == [
            p.learner for p in record.participants
        ]
        assert [p["weight"] for p in shown["participants"]] == [
            p.weight for p in record.participants
        ]
    for fragment in doc["fragments"]:
        newest = max(r for r in content.records if r % 2 == fragment["index"])
        assert fragment["round"] == newest
        assert fragment["version"] == content.records[newest].version
        theta = content.records[newest].theta
        assert fragment["theta"] == (None if theta is None else theta.sha256)
    assert doc["leases"] == []


def test_export_loads_into_the_model_and_equals_the_newest_versions(
    demo_run: DemoRun, tmp_path: Path
) -> None:
    store = demo_run.store
    out = tmp_path / "model.safetensors"
    result = cli("export", str(store), "--out", str(out))
    assert result.returncode == 0, result.stderr
    content = read_store(store)
    model = GPT(GPTConfig.tiny(vocab_size=64, context=16), seed=123)
    missing, unexpected = model.load_state_dict(safetensors.torch.load_file(str(out)), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    params = dict(model.named_parameters())
    for spec in content.manifest.fragments:
        newest = max(r for r in content.records if r % 2 == spec.index)
        assert f"fragment {spec.index}: version {content.records[newest].version} " in result.stdout
        for param, value in zip(spec.params, replayed_theta(content, newest), strict=True):
            assert torch.equal(window(params[param.name], param).detach(), value), param.name


def test_resuming_with_another_model_is_refused_before_any_learner_starts(
    demo_run: DemoRun,
) -> None:
    store = demo_run.store
    session = (store / "session.json").read_bytes()
    result = cli("demo", "--store", str(store), "--steps", "4", *TINY, "--model", "small")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "holds a run of another model" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert (store / "session.json").read_bytes() == session


async def _check(settings: DemoSettings) -> None:
    async with LocalMailbox(settings.store) as mailbox:
        await _check_run(_Session(settings, Console()), mailbox)


def test_resuming_with_another_config_is_refused(demo_run: DemoRun) -> None:
    stored = msgspec.json.decode((demo_run.store / "session.json").read_bytes(), type=DemoSettings)
    anyio.run(_check, stored)
    with pytest.raises(UsageError, match="sync_every=8 but these settings give 12"):
        anyio.run(_check, msgspec.structs.replace(stored, sync_every=12))
    with pytest.raises(UsageError, match="delta_encoding='fp32' but these settings give 'int8'"):
        anyio.run(_check, msgspec.structs.replace(stored, encoding="int8"))
