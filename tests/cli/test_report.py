"""``gradientmail report``: the document drawn from a run of known content, the page it
makes (self-contained, escaped), and the command (the browser's check is in
``test_report_browser.py``)."""

import dataclasses
import json
import re
from pathlib import Path

import msgspec
import pytest
from cli_helpers import WrittenRun, cli

from gradientmail.cli.report import content
from gradientmail.cli.report_page import page
from gradientmail.mailbox import LocalMailbox
from gradientmail.reader import Observation, RunReader

START = 1_780_000_000.0


def observed(written_run: WrittenRun) -> Observation:
    async def read() -> Observation:
        async with LocalMailbox(written_run.directory) as box:
            return await RunReader.of(box).observe(str(written_run.directory))

    import anyio

    observation = anyio.run(read)
    records = {}
    for round, record in observation.records.items():
        participants = tuple(
            msgspec.structs.replace(p, waited=0.1 * round) if p.learner == "beta" else p
            for p in record.participants
        )
        records[round] = msgspec.structs.replace(
            record, closed_at=START + 30 * round, participants=participants
        )
    return dataclasses.replace(observation, records=records)


PROGRESS = [
    json.dumps({"round": -1, "tokens": 0, "loss": 4.2, "seconds": 0.0}),
    "not json",
    json.dumps({"round": 2, "tokens": 800, "loss": "nan"}),
    json.dumps({"round": 4, "tokens": 1600, "loss": 3.1, "seconds": 9.5}),
]
EVENTS = [
    json.dumps({"event": "snapshot_published", "learner": "alpha", "round": r, "size": 1000})
    for r in (0, 1, 2)
] + [
    json.dumps({"event": "snapshot_published", "learner": "<b>beta</b>", "round": 0, "size": 7}),
    '{"event":"snapshot_published","learner":"alpha"}',
    json.dumps({"event": "joined", "learner": "alpha"}),
]


def test_the_report_document_holds_what_the_run_recorded(written_run: WrittenRun) -> None:
    doc = content(observed(written_run), PROGRESS, EVENTS)
    assert [r["round"] for r in doc["rounds"]] == [0, 1, 2, 3, 4]
    assert [r["closed_at"] for r in doc["rounds"]] == [START + 30 * r for r in range(5)]
    assert [(p["learner"], p["weight"]) for p in doc["rounds"][3]["participants"]] == [
        ("alpha", 0.75),
        ("beta", 0.25),
    ]
    assert doc["rounds"][3]["rejected"] == 1
    assert doc["progress"] == [
        {"loss": 4.2, "round": -1, "tokens": 0, "seconds": 0.0},
        {"loss": 3.1, "round": 4, "tokens": 1600, "seconds": 9.5},
    ]
    assert doc["learners"]["alpha"]["published"] == [(0, 1000), (1, 1000), (2, 1000)]
    assert doc["learners"]["alpha"]["waited"] == []
    assert doc["learners"]["beta"]["waited"] == [(r, pytest.approx(0.1 * r)) for r in range(5)]
    assert doc["learners"]["<b>beta</b>"]["published"] == [(0, 7)]
    manifest = written_run.manifest
    assert [f["parameters"] for f in doc["fragments"]] == [s.numel for s in manifest.fragments]
    assert sum(f["split"] for f in doc["fragments"]) > 0, "the written run splits by rows"
    assert doc["finished"] is False
    assert doc["problems"] == [
        "2 lines of the evaluations file skipped (no numeric loss)",
        "1 snapshot_published event lines skipped (malformed)",
    ]


def test_the_page_is_self_contained_and_escaped(written_run: WrittenRun) -> None:
    text = page(content(observed(written_run), PROGRESS, EVENTS))
    assert text.startswith("<!DOCTYPE html>")
    assert len(re.findall(r'<img alt="" src="data:image/png;base64,[A-Za-z0-9+/=]+">', text)) == 6
    assert not re.search(r"https?://|<script|<link|@import|url\(", text)
    assert "<b>beta</b>" not in text
    assert "&lt;b&gt;beta&lt;/b&gt;" in text
    for title in (
        "The shared model",
        "Rounds over time",
        "Participants and weights per round",
        "Learners: waiting and bytes",
        "The fragment split",
    ):
        assert f"<h2>{title}</h2>" in text


def test_a_page_says_what_the_run_did_not_record(written_run: WrittenRun) -> None:
    bare = observed(written_run)
    records = {
        r: msgspec.structs.replace(record, closed_at=msgspec.UNSET)
        for r, record in bare.records.items()
    }
    text = page(content(dataclasses.replace(bare, records=records)))
    assert "The run recorded no evaluations of the shared model" in text
    assert "The rounds&#x27; records carry no time." in text
    assert "No event log of the learners" in text
    assert text.count("data:image/png") == 3


def test_report_command_writes_the_page_with_the_files_beside_the_run(
    written_run: WrittenRun, tmp_path: Path
) -> None:
    progress = tmp_path / "eval.jsonl"
    progress.write_text("\n".join(PROGRESS) + "\n")
    out = tmp_path / "report.html"
    result = cli(
        "report", str(written_run.directory), "--out", str(out), "--progress", str(progress)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {out}: 5 rounds, 2 learners, 2 evaluations\n"
    text = out.read_text()
    assert "problem: 2 lines of the evaluations file skipped" in text
    assert "No event log of the learners" in text
    missing = cli("report", str(tmp_path / "nothing"), "--out", str(out))
    assert missing.returncode == 1
    assert "no such directory" in missing.stderr
