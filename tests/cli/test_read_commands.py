"""``status`` and ``export`` against a run of known content, and their errors: each command
and exit status at least once as a subprocess, the rest through ``cli.main`` in-process."""

import dataclasses
import io
import json
import re
import signal
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest
import safetensors
import safetensors.torch
import torch
from cli_helpers import FRAGMENTS, InProcess, WrittenRun, cli
from rich.console import Console

import gradientmail
from gradientmail.cli.status import console_for, document, render
from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.errors import RunMismatch
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.codec import encode_fragment
from gradientmail.protocol.fragments import window
from gradientmail.protocol.records import Manifest, Participant, decode, encode
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import Observation
from gradientmail.store import Store


def test_status_json_matches_the_records(written_run: WrittenRun) -> None:
    result = cli("status", str(written_run.directory), "--json", "--last", "3")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    manifest = written_run.manifest
    assert doc["manifest"]["created_by"] == "alpha"
    assert doc["manifest"]["signed"] is False
    assert doc["manifest"]["key_id"] is None
    assert doc["manifest"]["fragments"] == FRAGMENTS
    assert doc["manifest"]["parameters"] == GPT(GPTConfig.tiny()).num_parameters()
    assert doc["manifest"]["config"]["update_encoding"] == "int8"
    assert [f["version"] for f in doc["fragments"]] == [2, 2, 1]
    assert [f["round"] for f in doc["fragments"]] == [3, 4, 2]
    assert [f["theta"] for f in doc["fragments"]] == [
        written_run.records[r].theta.sha256 for r in (3, 4, 2)
    ]
    assert [r["round"] for r in doc["rounds"]] == [2, 3, 4]
    for shown in doc["rounds"]:
        record = written_run.records[shown["round"]]
        assert shown["committed_by"] == record.committed_by
        assert shown["participants"] == [
            {
                "learner": p.learner,
                "weight": p.weight,
                "steps": p.steps,
                "tokens": p.tokens,
                "base_version": p.base_version,
            }
            for p in record.participants
        ]
        assert [(x["learner"], x["reason"]) for x in shown["rejected"]] == [
            (x.learner, x.reason) for x in record.rejected
        ]
        assert shown["cosine"] == record.cosine
        assert shown["quorum_seconds"] == record.quorum_seconds
    assert doc["rounds"][0]["cosine"] is None
    assert doc["pending"] == {"round": 5, "fragment": 2, "snapshots": ["beta"], "claims": ["alpha"]}
    assert doc["leases"] == [
        {"learner": "alpha", "beat": 4, "beats": 2, "role": "learner", "live": None},
        {"learner": "beta", "beat": 7, "beats": 1, "role": "learner", "live": None},
    ]
    assert doc["totals"] == {
        "rounds": 5,
        "snapshots": 10,
        "rejected": 1,
        "steps": 80 / FRAGMENTS,
        "tokens": 2000 / FRAGMENTS,
        "rejected_tokens": 50 / FRAGMENTS,
        "tokens_by_fragment": [800, 800, 400],
    }
    assert doc["problems"] == []
    assert doc["verified"] is True
    # Each learner's pace: its steps per round; these records state no step times.
    taken: dict[str, list[int]] = {}
    for record in written_run.records.values():
        for p in record.participants:
            taken.setdefault(p.learner, []).append(p.steps)
    assert doc["learners"] == [
        {
            "learner": name,
            "rounds": len(steps),
            "steps_per_second": None,
            "steps_per_round": statistics.median(steps),
            "waited": None,
        }
        for name, steps in sorted(taken.items())
    ]
    # Every round had both learners holding a lease.
    assert doc["desync"] == {"flagged": False, "learners": 2, "rounds": 5, "short": []}
    assert len(manifest.fragments) == FRAGMENTS


def test_status_table_shows_the_run(written_run: WrittenRun, in_process: InProcess) -> None:
    result = in_process("status", str(written_run.directory))
    assert result.returncode == 0, result.stderr
    for text in (
        "created by alpha",
        "rounds (newest 5 of 5; times UTC)",
        "gamma: non-finite",
        "0.75",
        "claimed by alpha",
        "in flight round 5",
        "5 rounds committed",
        "learners (newest rounds)",
    ):
        assert text in result.stdout, text


def test_export_loads_into_the_model_and_equals_the_newest_versions(
    written_run: WrittenRun, tmp_path: Path
) -> None:
    out = tmp_path / "model.safetensors"
    result = cli("export", str(written_run.directory), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "fragment 0: version 2 from round 3" in result.stdout
    assert "fragment 2: version 1 from round 2" in result.stdout
    tensors = safetensors.torch.load_file(str(out))
    assert tensors.keys() == written_run.newest.keys()
    model = GPT(GPTConfig.tiny(), seed=99)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"]
    assert unexpected == []
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param.detach(), written_run.newest[name]), name
    with safetensors.safe_open(str(out), "pt") as f:
        sources = json.loads(f.metadata()["gradientmail"])
    assert sources == [
        {"fragment": 0, "version": 2, "round": 3},
        {"fragment": 1, "version": 2, "round": 4},
        {"fragment": 2, "version": 1, "round": 2},
    ]


def test_a_store_without_a_run_is_exit_1_with_a_message(
    tmp_path: Path, in_process: InProcess
) -> None:
    for run, args in (
        (cli, ("status", str(tmp_path))),
        (in_process, ("status", str(tmp_path / "nowhere"))),
        (cli, ("export", str(tmp_path), "--out", str(tmp_path / "m.safetensors"))),
        (in_process, ("status", "memory://")),
    ):
        result = run(*args)
        assert result.returncode == 1, (args, result)
        assert "no run" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "nowhere").exists(), "status must not create a store"


def test_a_bad_url_is_exit_1_and_debug_shows_the_traceback(in_process: InProcess) -> None:
    result = in_process("status", "ftp://example.com/x")
    assert result.returncode == 1
    assert "malformed mailbox URL" in result.stderr
    assert "Traceback" not in result.stderr
    debug = in_process("--debug", "status", "ftp://example.com/x")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr


def test_usage_errors_are_exit_2(in_process: InProcess) -> None:
    assert cli().returncode == 2
    assert in_process("status").returncode == 2
    assert in_process("export", "somewhere").returncode == 2
    assert in_process("demo", "--learners", "0").returncode == 2


def test_status_watch_refreshes_and_judges_liveness_over_time(written_run: WrittenRun) -> None:
    command = [
        sys.executable, "-m", "gradientmail", "status", str(written_run.directory), "--json",
        "--watch", "--interval", "0.2", "--lease-timeout", "0.5",
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout is not None
            docs = []
            deadline = time.monotonic() + 60
            # The beats never change, so each lease is trusted for one timeout, then not.
            while not docs or any(lease["live"] for lease in docs[-1]["leases"]):
                assert time.monotonic() < deadline, "the leases never stopped being live"
                docs.append(json.loads(p.stdout.readline()))
            p.send_signal(signal.SIGINT)
            _, stderr = p.communicate(timeout=20)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, stderr
    assert [lease["live"] for lease in docs[0]["leases"]] == [True, True]
    assert [lease["live"] for lease in docs[-1]["leases"]] == [False, False]
    assert all(doc["totals"]["rounds"] == 5 for doc in docs)


def test_s3_without_a_run_or_without_the_bucket_is_exit_1(
    moto_server: str, s3_bucket: str, in_process: InProcess
) -> None:
    empty = in_process("status", f"s3://{s3_bucket}/runs/a?endpoint_url={moto_server}")
    assert empty.returncode == 1, empty.stderr
    assert "no run here" in empty.stderr
    missing = in_process("status", f"s3://no-such-bucket-here/a?endpoint_url={moto_server}")
    assert missing.returncode == 1, missing.stderr
    assert "NoSuchBucket" in missing.stderr
    for result in (empty, missing):
        assert "Traceback" not in result.stderr


def test_status_shows_that_a_run_is_signed_and_by_which_key_id(
    written_run: WrittenRun, tmp_path: Path, in_process: InProcess
) -> None:
    run_key = RunKey("a secret of at least sixteen bytes")
    signed = tmp_path / "signed"

    async def sign() -> None:
        async with LocalMailbox(written_run.directory) as source, LocalMailbox(signed) as box:
            for key in await source.list(""):
                data = await source.get(key)
                assert data is not None
                if key == keys.MANIFEST:
                    data = encode(run_key.sign(key, decode(data, Manifest)))
                await box.put_if_absent(key, data)

    anyio.run(sign)
    result = in_process("status", str(signed), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["manifest"]["signed"] is True
    assert doc["manifest"]["key_id"] == run_key.key_id
    table = in_process("status", str(signed))
    assert table.returncode == 0, table.stderr
    assert f"signed (key id {run_key.key_id})" in table.stdout
    assert "a secret of at least sixteen bytes" not in table.stdout + result.stdout


SECRET = "the run key of the signed copy, long enough"


def _signed_copy(written_run: WrittenRun, target: Path) -> str:
    """A signed run with the content of ``written_run`` (its manifest and records signed by
    a ``Store`` holding the key, so bound to a fresh run id), then a keyless forgery of
    round 5's record with a θ of zeros at the record key. Returns the forged θ's sha256."""
    run_key = RunKey(SECRET)

    async def copy() -> str:
        async with LocalMailbox(written_run.directory) as source, LocalMailbox(target) as box:
            store = Store(box, run_key=run_key)
            await store.create_manifest(written_run.manifest)
            for key in await source.list(keys.BLOBS):
                data = await source.get(key)
                assert data is not None
                await box.put_if_absent(key, data)
            for record in written_run.records.values():
                await store.put_record(record)
            zeros = {n: torch.zeros_like(t) for n, t in written_run.newest.items()}
            spec = written_run.manifest.fragments[2]
            data = encode_fragment(
                [window(zeros[p.name], p) for p in spec.params], spec, "fp32", block_size=1
            )
            ref = await store.put_blob(data, "fp32")
            forged = msgspec.structs.replace(
                written_run.records[2], round=5, version=2, theta=ref, committed_by="mallory"
            )
            await box.put_if_absent(keys.record(5), encode(forged))
            return ref.sha256

    return anyio.run(copy)


def test_status_and_export_of_a_signed_run_verify_under_the_key(
    written_run: WrittenRun, tmp_path: Path, in_process: InProcess
) -> None:
    """Status and export read through the one read path, which checks what it reads:
    with the key, the keyless record is skipped (and
    shown as a problem); without it, status says the run is unverified and export refuses."""
    signed = tmp_path / "signed"
    forged = _signed_copy(written_run, signed)
    keyed = {"GRADIENTMAIL_RUN_KEY": SECRET}

    doc = json.loads(in_process("status", str(signed), "--json", env_extra=keyed).stdout)
    assert doc["verified"] is True
    assert doc["totals"]["rounds"] == 5
    assert [f["round"] for f in doc["fragments"]] == [3, 4, 2]
    assert any(keys.record(5) in problem for problem in doc["problems"])

    bare = in_process("status", str(signed), "--json")
    assert bare.returncode == 0, bare.stderr
    assert json.loads(bare.stdout)["verified"] is False
    table = in_process("status", str(signed))
    assert "UNVERIFIED" in table.stdout

    out = tmp_path / "m.safetensors"
    refused = in_process("export", str(signed), "--out", str(out))
    assert refused.returncode == 1
    assert "signed" in refused.stderr
    assert "GRADIENTMAIL_RUN_KEY" in refused.stderr
    assert not out.exists()
    done = in_process("export", str(signed), "--out", str(out), env_extra=keyed)
    assert done.returncode == 0, done.stderr
    tensors = safetensors.torch.load_file(str(out))
    for name, value in written_run.newest.items():
        assert torch.equal(tensors[name], value), name
    assert forged not in done.stdout


def test_export_is_written_with_the_users_umask(written_run: WrittenRun, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = cli("export", str(written_run.directory), "--out", str(out), umask=0o027)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_load_puts_the_newest_weights_into_a_module(written_run: WrittenRun) -> None:
    model = GPT(GPTConfig.tiny(), seed=99)
    sources = anyio.run(gradientmail.load, str(written_run.directory), model)
    assert [(s.fragment, s.version, s.round) for s in sources] == [(0, 2, 3), (1, 2, 4), (2, 1, 2)]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), written_run.newest[name]), name
    other = GPT(GPTConfig(vocab_size=7, context=8, d_model=8, n_layers=1, n_heads=1), seed=0)
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(RunMismatch):
        anyio.run(gradientmail.load, str(written_run.directory), other)
    for name, param in other.named_parameters():
        assert torch.equal(param.detach(), before[name])


def test_status_piped_uses_columns_or_160(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped, rich would render at 80 columns whatever ``$COLUMNS`` says."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert console_for().width == 160
    monkeypatch.setenv("COLUMNS", "80")
    assert console_for().width == 80


def _lines(doc: dict[str, object], width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width).print(render(doc))
    return out.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 120])
def test_status_fits_80_columns_one_line_per_round(written_run: WrittenRun, width: int) -> None:
    """At 80 columns as at 120, every header, id and round keeps to one line: no header
    broken ("parti/cipan/ts"), no id split ("host-" / "0"), one line per round."""
    observation = _observation(written_run, {})
    records = {
        r: msgspec.structs.replace(record, closed_at=1_780_000_000.0 + 60 * r)
        for r, record in observation.records.items()
    }
    doc = document(dataclasses.replace(observation, records=records), last=5)
    lines = _lines(doc, width)
    assert all(len(line) <= width for line in lines)
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "frag"])
    assert lines[header].split() == [
        "round",
        "frag",
        "closed",
        "by",
        "alpha",
        "beta",
        "rej",
        "cosine",
        "spread",
        "s",
    ]
    rows = [line.split() for line in lines[header + 2 : header + 7]]
    assert [row[0] for row in rows] == ["0", "1", "2", "3", "4"], lines
    for row, (_, record) in zip(rows, sorted(records.items()), strict=True):
        assert row[2] == time.strftime("%H:%M:%S", time.gmtime(record.closed_at)), row
        assert row[3] == record.committed_by
        assert row[4:6] == ["0.75", "0.25"], row
    assert "round 3 rejected gamma: non-finite" in lines
    fragments = next(i for i, line in enumerate(lines) if line.split()[:1] == ["fragment"])
    assert lines[fragments].split() == [
        "fragment",
        "tensors",
        "parameters",
        "version",
        "from",
        "round",
        "theta",
    ]
    leases = next(i for i, line in enumerate(lines) if line.split()[:1] == ["learner"])
    assert lines[leases].split() == ["learner", "newest", "beat", "beats", "live"]


def test_status_at_80_columns_with_many_learners_cuts_only_the_weights(
    written_run: WrittenRun,
) -> None:
    """Learners whose weight columns do not fit share one column, cut at its end: a round
    stays one line, and every id shown before the cut is whole."""
    observation = _observation(written_run, {})
    many = tuple(
        Participant(learner=f"host-{k}", weight=0.125, steps=8, tokens=100, base_version=0)
        for k in range(8)
    )
    records = {
        r: msgspec.structs.replace(record, participants=many)
        for r, record in observation.records.items()
    }
    lines = _lines(document(dataclasses.replace(observation, records=records), last=5), 80)
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "frag"])
    assert lines[header].split()[:5] == ["round", "frag", "closed", "by", "weights"]
    rows = lines[header + 2 : header + 7]
    assert [row.split()[0] for row in rows] == ["0", "1", "2", "3", "4"], lines
    for row in rows:
        assert len(row) <= 80
        assert "host-0 0.12 host-1 0.12" in row
        assert "…" in row


def test_status_says_when_a_run_is_finished(written_run: WrittenRun) -> None:
    """A run no node holds a lease in is finished: status says so and when its newest round
    committed, and names the round it left unfinished rather than showing it in flight."""
    observation = _observation(written_run, {})
    records = dict(observation.records)
    records[4] = msgspec.structs.replace(records[4], closed_at=1_780_000_000.0)
    observation = dataclasses.replace(
        observation, records=records, leases={}, snapshots=("beta",), claims=("alpha",)
    )
    doc = document(observation, last=5)
    assert doc["finished"] is True
    assert doc["rounds"][-1]["closed_at"] == 1_780_000_000.0
    text = " ".join(" ".join(_lines(doc, 80)).split())
    assert "in flight" not in text
    assert (
        "finished no node of this run is running; round 4 committed at 2026-05-28 20:26:40 UTC;"
        " round 5 was left unfinished (snapshots from beta; claimed by alpha)"
    ) in text
    running = document(_observation(written_run, {}), last=5)
    assert running["finished"] is False
    assert "in flight round 5" in " ".join(_lines(running, 80))


def _observation(written_run: WrittenRun, participants: dict[int, int]) -> Observation:
    records = {
        round: msgspec.structs.replace(
            record, participants=record.participants[: participants.get(round, 2)]
        )
        for round, record in written_run.records.items()
    }
    return Observation(
        url="x",
        manifest=written_run.manifest,
        records=records,
        leases={"alpha": (4, 2, "learner"), "beta": (7, 1, "learner"), "s": (1, 1, "syncer")},
        pending=5,
        snapshots=(),
        claims=(),
    )


def test_status_flags_a_desynchronized_run(written_run: WrittenRun) -> None:
    """Rounds alternating one learner at a time (or empty) are flagged."""
    steady = document(_observation(written_run, {}), last=5)
    assert steady["desync"]["flagged"] is False
    drifted = document(_observation(written_run, {1: 1, 2: 0, 3: 1, 4: 1}), last=5)
    assert drifted["desync"] == {"flagged": True, "learners": 2, "rounds": 5, "short": [1, 2, 3, 4]}
    out = io.StringIO()
    Console(file=out, width=200).print(render(drifted))
    assert "desynchronized: 4 of the newest 5 rounds" in out.getvalue()
    # Judged live: only alpha is running, so one participant per round is everyone.
    alone = document(
        _observation(written_run, {1: 1, 3: 1, 4: 1}), last=5, live=frozenset({"alpha"})
    )
    assert alone["desync"]["flagged"] is False


def test_status_shows_who_the_others_wait_for(written_run: WrittenRun) -> None:
    """Each round's first-to-last arrival spread and who came last (the closer's
    ``Participant.arrived``), and over the rounds listed the median and the learner last
    most often; in a round whose last listing held both, nobody came last; a record without
    arrivals shows none."""
    late = {0: "beta", 1: "beta", 2: "alpha", 3: "beta"}
    records = {}
    for round, record in written_run.records.items():
        names = [p.learner for p in record.participants]
        assert len(names) == 2, names
        times = dict.fromkeys(names, 0.0)
        if round in late:
            times[late[round]] = 0.1 * (round + 1)
        participants = tuple(
            msgspec.structs.replace(p, arrived=times[p.learner]) for p in record.participants
        )
        records[round] = msgspec.structs.replace(record, participants=participants)
    observation = _observation(written_run, {})
    doc = document(dataclasses.replace(observation, records=records), last=5)
    shown = [(r["round"], r["spread_seconds"], r["last_in"]) for r in doc["rounds"]]
    assert shown == [
        (0, pytest.approx(0.1), "beta"),
        (1, pytest.approx(0.2), "beta"),
        (2, pytest.approx(0.3), "alpha"),
        (3, pytest.approx(0.4), "beta"),
        (4, 0.0, None),
    ]
    assert doc["arrivals"] == {
        "rounds": 5,
        "median_spread_seconds": pytest.approx(0.2),
        "last_most": "beta",
        "last_count": 3,
    }
    out = io.StringIO()
    Console(file=out, width=240).print(render(doc))
    text = out.getvalue()
    assert re.search(r"alpha\s+0\.75\s+0\.25\*\s+1\s+0\.900\s+0\.40", text), text
    assert (
        "median first-to-last spread 0.20 s over 5 rounds listed; last in most: beta (3 of 5)"
        in text
    )
    plain = document(observation, last=5)
    assert plain["arrivals"]["rounds"] == 0
    out = io.StringIO()
    Console(file=out, width=240).print(render(plain))
    assert "arrivals:" not in out.getvalue()
