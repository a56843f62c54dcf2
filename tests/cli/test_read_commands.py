"""``status`` and ``export`` as subprocesses against a run of known content, and their errors."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import safetensors
import safetensors.torch
import torch
from cli_helpers import FRAGMENTS, WrittenRun, cli

from gradientmail.demo.model import GPT, GPTConfig
from gradientmail.mailbox import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import Manifest, decode, encode
from gradientmail.protocol.signing import RunKey


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
        {"learner": "alpha", "beat": 4, "beats": 2, "live": None},
        {"learner": "beta", "beat": 7, "beats": 1, "live": None},
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
    assert len(manifest.fragments) == FRAGMENTS


def test_status_table_shows_the_run(written_run: WrittenRun) -> None:
    result = cli("status", str(written_run.directory))
    assert result.returncode == 0, result.stderr
    for text in (
        "created by alpha",
        "rounds (newest 5 of 5)",
        "gamma: non-finite",
        "alpha 0.75",
        "claimed by alpha",
        "5 rounds committed",
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


def test_a_store_without_a_run_is_exit_1_with_a_message(tmp_path: Path) -> None:
    for args in (
        ("status", str(tmp_path)),
        ("status", str(tmp_path / "nowhere")),
        ("export", str(tmp_path), "--out", str(tmp_path / "m.safetensors")),
        ("status", "memory://"),
    ):
        result = cli(*args)
        assert result.returncode == 1, (args, result)
        assert "no run" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "nowhere").exists(), "status must not create a store"


def test_a_bad_url_is_exit_1_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = cli("status", "ftp://example.com/x")
    assert result.returncode == 1
    assert "malformed mailbox URL" in result.stderr
    assert "Traceback" not in result.stderr
    debug = cli("--debug", "status", "ftp://example.com/x")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr


def test_usage_errors_are_exit_2() -> None:
    assert cli().returncode == 2
    assert cli("status").returncode == 2
    assert cli("export", "somewhere").returncode == 2
    assert cli("demo", "--learners", "0").returncode == 2


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


def test_s3_without_a_run_or_without_the_bucket_is_exit_1(moto_server: str, s3_bucket: str) -> None:
    empty = cli("status", f"s3://{s3_bucket}/runs/a?endpoint_url={moto_server}")
    assert empty.returncode == 1, empty.stderr
    assert "no run here" in empty.stderr
    missing = cli("status", f"s3://no-such-bucket-here/a?endpoint_url={moto_server}")
    assert missing.returncode == 1, missing.stderr
    assert "NoSuchBucket" in missing.stderr
    for result in (empty, missing):
        assert "Traceback" not in result.stderr


def test_status_shows_that_a_run_is_signed_and_by_which_key_id(
    written_run: WrittenRun, tmp_path: Path
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
    result = cli("status", str(signed), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["manifest"]["signed"] is True
    assert doc["manifest"]["key_id"] == run_key.key_id
    table = cli("status", str(signed))
    assert table.returncode == 0, table.stderr
    assert f"signed (key id {run_key.key_id})" in table.stdout
    assert "a secret of at least sixteen bytes" not in table.stdout + result.stdout
