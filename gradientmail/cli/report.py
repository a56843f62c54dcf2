"""``gradientmail report URL --out report.html``: one self-contained page about a run.

Three parts, as in ``status``: ``report`` reads the run through ``RunReader`` (the only
I/O) and, for a run in a local directory, the files a run may keep beside it: the shared
model's evaluations (``eval.jsonl``, one JSON object a line with ``loss`` and ``round`` or
``tokens``, as ``gradientmail demo`` writes it) and the learners' event logs
(``events/*.jsonl``, ``gradientmail.events.json_logs``); ``content`` turns what was read
into a JSON-ready document (pure); ``report_page.page`` draws it (pure). Lines of those
files that are not what they should be are skipped and counted as problems: they are
read like anything else from the store, as hostile.
"""

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio.to_thread
import msgspec

from gradientmail.cli.report_page import page
from gradientmail.errors import NoRun, UsageError
from gradientmail.protocol.records import RoundRecord
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import Observation, RunReader, open_mailbox

__all__ = ["content", "report"]

MAX_FILE_BYTES = 64 << 20
"""The most of an evaluations or events file a report reads."""


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _progress(lines: Iterable[str]) -> tuple[list[dict[str, float]], int]:
    points, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            bad += 1
            continue
        loss = _number(item.get("loss")) if isinstance(item, dict) else None
        if loss is None or not isinstance(item, dict):
            bad += 1
            continue
        point = {"loss": loss}
        for axis in ("round", "tokens", "seconds"):
            value = _number(item.get(axis))
            if value is not None:
                point[axis] = value
        points.append(point)
    return points, bad


def _events(lines: Iterable[str]) -> tuple[dict[str, list[tuple[int, int]]], int]:
    """Each learner's published snapshots as ``(round, size)`` from event log lines."""
    sizes: dict[str, list[tuple[int, int]]] = {}
    bad = 0
    for line in lines:
        if '"snapshot_published"' not in line:
            continue
        try:
            item = json.loads(line)
            learner, round, size = item["learner"], item["round"], item["size"]
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        if not (isinstance(learner, str) and type(round) is int and type(size) is int):
            bad += 1
            continue
        sizes.setdefault(learner, []).append((round, size))
    return sizes, bad


def content(
    observation: Observation,
    progress: Iterable[str] = (),
    events: Iterable[str] = (),
) -> dict[str, Any]:
    """The report of ``observation``, with the lines of an evaluations file and of event
    logs (any order, several learners), as plain JSON values (pure)."""
    manifest = observation.manifest
    points, bad_points = _progress(progress)
    published, bad_events = _events(events)
    rounds = [_round(observation.records[r]) for r in sorted(observation.records)]
    problems = list(observation.problems)
    if bad_points:
        problems.append(f"{bad_points} lines of the evaluations file skipped (no numeric loss)")
    if bad_events:
        problems.append(f"{bad_events} snapshot_published event lines skipped (malformed)")
    return {
        "url": observation.url,
        "created_by": manifest.created_by,
        "config": msgspec.to_builtins(manifest.config.resolved()),
        "fragments": [
            {
                "index": spec.index,
                "parameters": spec.numel,
                "tensors": len(spec.params),
                "split": sum(not isinstance(p.start, msgspec.UnsetType) for p in spec.params),
            }
            for spec in manifest.fragments
        ],
        "rounds": rounds,
        "progress": points,
        "learners": _learners(rounds, published),
        "finished": not observation.leases,
        "verified": observation.verified,
        "problems": problems,
    }


def _round(record: RoundRecord) -> dict[str, Any]:
    """One round of the report: when it closed, its participants, how many it rejected."""
    return {
        "round": record.round,
        "fragment": record.fragment,
        "closed_at": None if isinstance(record.closed_at, msgspec.UnsetType) else record.closed_at,
        "participants": [
            {
                "learner": p.learner,
                "weight": p.weight,
                "steps": p.steps,
                "tokens": p.tokens,
                "waited": None if isinstance(p.waited, msgspec.UnsetType) else p.waited,
            }
            for p in record.participants
        ],
        "rejected": len(record.rejected),
    }


def _learners(
    rounds: list[dict[str, Any]], published: dict[str, list[tuple[int, int]]]
) -> dict[str, dict[str, Any]]:
    """Each learner of the report (a participant or a publisher): the snapshots it published
    and, per round it took part in, how long it waited."""
    names = sorted({p["learner"] for r in rounds for p in r["participants"]} | set(published))
    return {
        name: {
            "published": sorted(published.get(name, [])),
            "waited": [
                (r["round"], p["waited"])
                for r in rounds
                for p in r["participants"]
                if p["learner"] == name and p["waited"] is not None
            ],
        }
        for name in names
    }


def _lines(path: Path | None) -> list[str]:
    if path is None or not path.is_file():
        return []
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES)
    return data.decode("utf-8", errors="replace").splitlines()


def _beside(url: str) -> Path | None:
    """The directory of a run stored in a local directory, None for another store."""
    if "://" in url and not url.startswith("file://"):
        return None
    return Path(url.removeprefix("file://"))


async def report(
    url: str, out: Path, *, progress: Path | None = None, events: Path | None = None
) -> dict[str, Any]:
    """Write the report of the run at ``url`` to ``out`` and return its document.
    ``progress`` (an evaluations file) and ``events`` (a directory of event logs) default
    to ``eval.jsonl`` and ``events/`` in the run's directory when it is a local one; what
    is not there is left out of the page, which says so.

    Raises ``UsageError`` when there is no store or no run, ``MailboxUnavailable`` when the
    store stays out of reach over a few retries, ``OSError`` when ``out`` cannot be written.
    """
    async with open_mailbox(url, must_exist=True) as mailbox:
        reader = RunReader.of(mailbox, RunKey.from_env(), unverified=True)
        try:
            await reader.manifest()
        except NoRun as exc:
            raise UsageError(f"{url}: {exc}") from exc
        observation = await reader.observe(url)
    return await anyio.to_thread.run_sync(_write, observation, out, progress, events)


def _write(
    observation: Observation, out: Path, progress: Path | None, events: Path | None
) -> dict[str, Any]:
    beside = _beside(observation.url)
    if beside is not None:
        progress = progress if progress is not None else beside / "eval.jsonl"
        events = events if events is not None else beside / "events"
    logs = sorted(events.glob("*.jsonl")) if events is not None and events.is_dir() else []
    doc = content(observation, _lines(progress), (line for log in logs for line in _lines(log)))
    out.write_text(page(doc), encoding="utf-8")
    return doc


def summary(doc: Mapping[str, Any]) -> str:
    """One line about a written report."""
    return (
        f"{len(doc['rounds'])} rounds, {len(doc['learners'])} learners, "
        f"{len(doc['progress'])} evaluations"
    )
