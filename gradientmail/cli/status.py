"""``gradientmail status URL``: what a run holds, as a table or as one JSON document.

Three parts: ``gradientmail.reader.RunReader`` reads the run (the only I/O, through the one
read path: objects checked, junk skipped and listed as problems, signatures verified under
``GRADIENTMAIL_RUN_KEY``; a signed run read without its key is shown, marked unverified);
``document`` turns one ``Observation`` into the JSON-ready status (pure); ``render`` draws
that document as rich tables (pure), so the table and ``--json`` always show the same thing.
Tables use the whole width of a terminal; piped or redirected, their cells wrap at
``$COLUMNS`` (default 160) instead of being cut.

A run is flagged ``desynchronized`` when most of its newest rounds (up to two per fragment)
closed with fewer participants than the learners running (live, under ``--watch``; else
holding a learner or closing lease) or empty: learners that drifted apart no longer meet in a round.
Each learner's pace shows in ``learners`` (``cli.learners.paces``: its step rate, local
steps per round and share of time waiting, from the newest rounds). Learners that still
meet but at different times show in the arrivals (``Participant.arrived``,
noted by the closer): each round's first-to-last spread and who came last, and over the rounds
listed the median spread and the learner last most often, the one the others wait for.

Liveness needs time: one reading shows each lease's newest beat and how many beats are in
the store, and ``live`` is null. ``--watch`` reads again every ``--interval`` seconds and
judges a lease live while its newest beat changed within ``--lease-timeout`` seconds
(``gradientmail.protocol.liveness.Liveness``), as a syncer does.
"""

import contextlib
import json
import math
import os
import signal
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from gradientmail.cli._tables import column_of, in_flight_line, rounds_table, table
from gradientmail.cli.learners import paces
from gradientmail.clock import MonotonicClock
from gradientmail.errors import NoRun, UsageError
from gradientmail.protocol import keys
from gradientmail.protocol.liveness import Liveness
from gradientmail.protocol.records import BlobRef, Manifest, RoundRecord
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import Observation, RunReader, open_mailbox

__all__ = ["arrival_spreads", "console_for", "desync", "document", "render", "status"]

_PIPED_WIDTH = 160
"""Columns of a table written to a pipe or file when ``$COLUMNS`` does not say."""


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def document(
    observation: Observation, *, last: int, live: frozenset[str] | None = None
) -> dict[str, Any]:
    """The status of ``observation`` as plain JSON values (pure).

    ``last`` is how many of the newest rounds to list; ``live`` the learners judged live
    (None: not judged, and every lease's ``live`` is null). Every local step reaches the
    model once per fragment, so the totals of steps and tokens are means over fragments
    (exact counts per fragment in ``tokens_by_fragment``).
    """
    manifest = observation.manifest
    count = len(manifest.fragments)
    ordered = [observation.records[r] for r in sorted(observation.records)]
    rounds = [_round(record) for record in (ordered[-last:] if last > 0 else [])]
    return {
        "url": observation.url,
        "manifest": {
            "created_by": manifest.created_by,
            "signed": isinstance(manifest.key_id, str),
            "key_id": manifest.key_id if isinstance(manifest.key_id, str) else None,
            "fragments": count,
            "tensors": len({param.name for spec in manifest.fragments for param in spec.params}),
            "parameters": sum(spec.numel for spec in manifest.fragments),
            "config": msgspec.to_builtins(manifest.config.resolved()),
        },
        "fragments": _fragments(manifest, ordered),
        "rounds": rounds,
        "pending": {
            "round": observation.pending,
            "fragment": keys.fragment_of(observation.pending, count),
            "snapshots": list(observation.snapshots),
            "claims": list(observation.claims),
        },
        "leases": [
            {
                "learner": learner,
                "beat": beat,
                "beats": beats,
                "role": role,
                "live": None if live is None else learner in live,
            }
            for learner, (beat, beats, role) in sorted(observation.leases.items())
        ],
        "totals": _totals(ordered, count),
        "finished": not observation.leases,
        "desync": desync(observation, live),
        "arrivals": arrival_spreads(rounds),
        "learners": paces(ordered),
        "verified": observation.verified,
        "problems": list(observation.problems),
    }


def _fragments(manifest: Manifest, ordered: list[RoundRecord]) -> list[dict[str, Any]]:
    """Each fragment of the document: its size, and its newest version among the records
    (``ordered`` by round) with the round that made it and its θ blob."""
    newest = {record.fragment: record for record in ordered}
    fragments = []
    for spec, theta0 in zip(manifest.fragments, manifest.theta0, strict=True):
        latest = newest.get(spec.index)
        fragments.append(
            {
                "index": spec.index,
                "tensors": len(spec.params),
                "parameters": spec.numel,
                "version": 0 if latest is None else latest.version,
                "round": None if latest is None else latest.round,
                "theta": _theta(theta0, latest),
            }
        )
    return fragments


def _round(record: RoundRecord) -> dict[str, Any]:
    """One listed round of the document (non-finite figures as None)."""
    return {
        "round": record.round,
        "fragment": record.fragment,
        "version": record.version,
        "committed_by": record.committed_by,
        "participants": [msgspec.to_builtins(p) for p in record.participants],
        "rejected": [msgspec.to_builtins(r) for r in record.rejected],
        "quorum_seconds": _finite(record.quorum_seconds),
        "grace_seconds": _finite(record.grace_seconds),
        "cosine": _finite(record.cosine),
        "closed_at": None if isinstance(record.closed_at, msgspec.UnsetType) else record.closed_at,
        **_last_in(record),
    }


def _totals(ordered: list[RoundRecord], count: int) -> dict[str, Any]:
    """What the committed rounds (``ordered``) counted, steps and tokens as means over the
    ``count`` fragments (exact per fragment in ``tokens_by_fragment``)."""
    participants = [p for record in ordered for p in record.participants]
    rejected = [r for record in ordered for r in record.rejected]
    tokens_by_fragment = [0] * count
    for record in ordered:
        if 0 <= record.fragment < count:
            tokens_by_fragment[record.fragment] += sum(p.tokens for p in record.participants)
    return {
        "rounds": len(ordered),
        "snapshots": len(participants),
        "rejected": len(rejected),
        "steps": sum(p.steps for p in participants) / count,
        "tokens": sum(p.tokens for p in participants) / count,
        "rejected_tokens": sum(r.tokens for r in rejected) / count,
        "tokens_by_fragment": tokens_by_fragment,
    }


def desync(observation: Observation, live: frozenset[str] | None = None) -> dict[str, Any]:
    """Whether the run's learners have drifted apart (pure): of the newest rounds (two per
    fragment), those that closed empty or with fewer participants than the learners running
    (``live`` when judged, else the nodes whose newest beat says learner or closing), and
    ``flagged`` when they are most of them."""
    learners = {
        learner for learner, (_, _, role) in observation.leases.items() if keys.trains(role)
    }
    if live is not None:
        learners &= live
    window = 2 * len(observation.manifest.fragments)
    newest = [observation.records[r] for r in sorted(observation.records)[-window:]]
    short = [
        record.round
        for record in newest
        if not record.participants or len(record.participants) < len(learners)
    ]
    return {
        "flagged": bool(newest) and len(short) * 2 > len(newest),
        "learners": len(learners),
        "rounds": len(newest),
        "short": short,
    }


def _last_in(record: RoundRecord) -> dict[str, Any]:
    """The round's first-to-last arrival spread (None unless two or more participants carry
    an arrival) and the learner that came last (None too when several share the last
    listing: nobody waited on one of them)."""
    times = [(p.arrived, p.learner) for p in record.participants if isinstance(p.arrived, float)]
    if len(times) < 2:
        return {"spread_seconds": None, "last_in": None}
    newest = max(t for t, _ in times)
    last = [learner for t, learner in times if t == newest]
    return {
        "spread_seconds": newest - min(t for t, _ in times),
        "last_in": last[0] if len(last) == 1 else None,
    }


def arrival_spreads(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the ``rounds`` of a status document that carry a spread: how many, their median
    spread, and the learner last in most of them with how often (pure; None and 0 when no
    round carries a spread, or no round had one learner last)."""
    spreads = sorted(r["spread_seconds"] for r in rounds if r["spread_seconds"] is not None)
    lasts = [r["last_in"] for r in rounds if r["last_in"] is not None]
    if not spreads:
        return {"rounds": 0, "median_spread_seconds": None, "last_most": None, "last_count": 0}
    most = max(sorted(set(lasts)), key=lasts.count) if lasts else None
    return {
        "rounds": len(spreads),
        "median_spread_seconds": spreads[len(spreads) // 2],
        "last_most": most,
        "last_count": lasts.count(most) if most is not None else 0,
    }


def console_for() -> Console:
    """A console on stdout: a terminal's own width, else ``$COLUMNS`` or ``_PIPED_WIDTH``
    (rich would otherwise render a pipe at 80 columns and cut cells)."""
    console = Console()
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() else _PIPED_WIDTH)


def render(doc: Mapping[str, Any]) -> RenderableType:
    """The status document as rich tables (pure: builds renderables, prints nothing)."""
    rejections = [
        Text(f"round {r['round']} rejected {x['learner']}: {x['reason']}")
        for r in doc["rounds"]
        for x in r["rejected"]
    ]
    parts: list[RenderableType] = [
        _head(doc),
        _fragments_table(doc),
        rounds_table(doc),
        *rejections,
        in_flight_line(doc),
        _leases_table(doc),
        *_learners(doc["learners"]),
        _summary(doc["totals"]),
        *_notes(doc),
    ]
    if not doc["verified"]:
        parts.insert(
            0,
            Text(
                "UNVERIFIED: this run is signed and was read without its key "
                "(GRADIENTMAIL_RUN_KEY); anyone could have written what is shown",
                style="bold red",
            ),
        )
    parts.extend(Text(f"problem: {p}", style="yellow") for p in doc["problems"])
    return Group(*parts)


def _head(doc: Mapping[str, Any]) -> Text:
    """The run's URL, creator, size, signing and config."""
    manifest = doc["manifest"]
    config = " ".join(f"{k}={v}" for k, v in manifest["config"].items())
    return Text.assemble(
        ("run ", "bold"),
        (doc["url"], "bold cyan"),
        f"  created by {manifest['created_by']}: {manifest['parameters']:,} parameters in "
        f"{manifest['tensors']} tensors, {manifest['fragments']} fragments, "
        + (f"signed (key id {manifest['key_id']})" if manifest["signed"] else "unsigned")
        + "\n",
        ("config ", "dim"),
        config,
    )


def _fragments_table(doc: Mapping[str, Any]) -> RenderableType:
    fragments = table("fragments")
    for column in ("fragment", "tensors", "parameters", "version", "from round", "theta"):
        column_of(fragments, column, "left" if column == "theta" else "right")
    for f in doc["fragments"]:
        fragments.add_row(
            str(f["index"]),
            str(f["tensors"]),
            f"{f['parameters']:,}",
            str(f["version"]),
            "Θ⁰" if f["round"] is None else str(f["round"]),
            "–" if f["theta"] is None else f["theta"][:12],
        )
    return fragments


def _leases_table(doc: Mapping[str, Any]) -> RenderableType:
    """The leases as a table, or a line saying there are none."""
    if not doc["leases"]:
        return Text("leases: none (no node of this run is running)")
    leases = table("leases")
    for column in ("learner", "newest beat", "beats", "live"):
        column_of(leases, column, "left" if column == "learner" else "right")
    for lease in doc["leases"]:
        live = lease["live"]
        leases.add_row(
            lease["learner"],
            str(lease["beat"]),
            str(lease["beats"]),
            "?" if live is None else ("[green]yes[/]" if live else "[red]no[/]"),
        )
    return leases


def _summary(totals: Mapping[str, Any]) -> Text:
    return Text(
        f"{totals['rounds']} rounds committed: {totals['snapshots']} snapshots, "
        f"{totals['steps']:,.0f} steps and {totals['tokens']:,.0f} tokens per fragment; "
        f"{totals['rejected']} snapshots rejected ({totals['rejected_tokens']:,.0f} tokens "
        "per fragment)"
    )


def _notes(doc: Mapping[str, Any]) -> list[RenderableType]:
    """The arrivals line when rounds carry a spread, and the desynchronization warning."""
    notes: list[RenderableType] = []
    came = doc["arrivals"]
    if came["rounds"]:
        notes.append(
            Text(
                f"arrivals: median first-to-last spread {came['median_spread_seconds']:.2f} s "
                f"over {came['rounds']} rounds listed"
                + (
                    f"; last in most: {came['last_most']} ({came['last_count']} of "
                    f"{came['rounds']})"
                    if came["last_most"] is not None
                    else "; no learner came last alone"
                )
            )
        )
    flag = doc["desync"]
    if flag["flagged"]:
        notes.append(
            Text(
                f"desynchronized: {len(flag['short'])} of the newest {flag['rounds']} rounds "
                f"closed empty or with fewer participants than the {flag['learners']} learners "
                f"running (rounds {', '.join(map(str, flag['short']))})",
                style="bold yellow",
            )
        )
    return notes


def _learners(learners: list[dict[str, Any]]) -> list[RenderableType]:
    """Each learner's pace (``cli.learners.paces``) as a table; nothing for none."""
    if not learners:
        return []
    paced = table("learners (newest rounds)")
    for column in ("learner", "steps/s", "steps/round", "waiting"):
        column_of(paced, column, "left" if column == "learner" else "right")
    for x in learners:
        rate, waited = x["steps_per_second"], x["waited"]
        paced.add_row(
            x["learner"],
            "–" if rate is None else f"{rate:.2f}",
            f"{x['steps_per_round']:g}",
            "–" if waited is None else f"{waited:.0%}",
        )
    return [paced]


async def status(
    url: str,
    *,
    last: int = 10,
    as_json: bool = False,
    watch: bool = False,
    interval: float = 2.0,
    lease_timeout: float = 10.0,
    console: Console | None = None,
) -> None:
    """Print the status of the run at ``url`` once, or with ``watch`` every ``interval``
    seconds until cancelled or sent SIGINT or SIGTERM, then return normally (``--json
    --watch`` prints one JSON document per line). With ``watch`` it must run in the main
    thread (it installs signal handlers for its duration).

    Raises ``UsageError`` when there is no store or no run, ``MailboxUnavailable`` when the
    store stays out of reach over a few retries.
    """
    out = console if console is not None else console_for()
    async with open_mailbox(url, must_exist=True) as mailbox:
        reader = RunReader.of(mailbox, RunKey.from_env(), unverified=True)
        try:
            await reader.manifest()
        except NoRun as exc:
            raise UsageError(f"{url}: {exc}") from exc
        if not watch:
            doc = document(await reader.observe(url), last=last)
            if as_json:
                print(json.dumps(doc, indent=2))
            else:
                out.print(render(doc))
            return
        await _watch(reader, url, last, as_json, interval, Liveness(timeout=lease_timeout), out)


async def _watch(
    reader: RunReader,
    url: str,
    last: int,
    as_json: bool,
    interval: float,
    liveness: Liveness,
    out: Console,
) -> None:
    """``status --watch``: observe every ``interval`` seconds, judging the leases with
    ``liveness``, until SIGINT or SIGTERM (main thread only)."""
    clock = MonotonicClock()
    with (
        contextlib.ExitStack() as stack,
        anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):
        view = None if as_json else stack.enter_context(Live(console=out, auto_refresh=False))
        async with anyio.create_task_group() as group:

            async def until_signal() -> None:
                # The loop's own SIGINT handling cancels the main task natively, which a
                # cancel scope exiting at that moment can absorb (seen: a watch that
                # ignored SIGINT under load); a signal receiver stops it on either loop.
                async for _ in signals:
                    group.cancel_scope.cancel()
                    return

            group.start_soon(until_signal)
            while True:
                observation = await reader.observe(url)
                now = clock.now()
                beats = {learner: lease[0] for learner, lease in observation.leases.items()}
                liveness = liveness.observed(beats, now)
                doc = document(observation, last=last, live=liveness.live(now))
                if view is None:
                    print(json.dumps(doc), flush=True)
                else:
                    view.update(render(doc), refresh=True)
                await anyio.sleep(interval)


def _theta(theta0: BlobRef, latest: RoundRecord | None) -> str | None:
    """The sha256 of the θ blob of the fragment's newest version: Θ⁰, or its record's at a
    checkpoint; None between checkpoints (only the update is stored)."""
    if latest is None:
        return theta0.sha256
    return None if latest.theta is None else latest.theta.sha256
