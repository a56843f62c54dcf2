"""``gradientmail status URL``: what a run holds, as a table or as one JSON document.

Three parts: ``RunReader`` reads the run's objects from a mailbox (the only I/O, keeping the
immutable round records it has read so a watch re-reads only new ones); ``document`` turns
one ``Observation`` into the JSON-ready status (pure); ``render`` draws that document as
rich tables (pure), so the table and ``--json`` always show the same thing.

Liveness needs time: one reading shows each lease's newest beat and how many beats are in
the store, and ``live`` is null. ``--watch`` reads again every ``--interval`` seconds and
judges a lease live while its newest beat changed within ``--lease-timeout`` seconds
(``gradientmail.lease.Liveness``), as a syncer does.
"""

import contextlib
import json
import math
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gradientmail.cli._common import open_store
from gradientmail.cli._errors import CliError
from gradientmail.clock import MonotonicClock
from gradientmail.errors import RecordError
from gradientmail.lease import Liveness
from gradientmail.mailbox import Mailbox, retrying
from gradientmail.protocol import keys
from gradientmail.protocol.records import CreateClaim, Manifest, RoundClaim, RoundRecord, decode

__all__ = ["Observation", "RunReader", "document", "render", "status"]

_CONCURRENT_READS = 16
_READ_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class Observation:
    """One reading of a run.

    ``records`` holds every round record read so far by round; ``leases`` maps a learner to
    ``(newest beat, beats in the store)``; ``pending`` is the first round without a record,
    the learners with a snapshot in it and its claimants in claim order; ``problems`` are
    objects that could not be decoded (shown, never fatal).
    """

    url: str
    manifest: Manifest
    records: Mapping[int, RoundRecord]
    leases: Mapping[str, tuple[int, int]]
    pending: int
    snapshots: tuple[str, ...]
    claims: tuple[str, ...]
    problems: tuple[str, ...] = ()


class RunReader:
    """Reads the run at ``url`` from ``mailbox``; reuse one reader to re-read cheaply
    (round records never change, so each is read once).

    Each operation retries a transient store failure a few times (``retrying``) and then
    lets ``MailboxUnavailable`` propagate. Runs in the caller's task, one call at a time;
    cancellation stops the reads in flight and leaves the reader usable.
    """

    def __init__(self, mailbox: Mailbox, url: str) -> None:
        self.mailbox = mailbox
        self.url = url
        self._records: dict[int, RoundRecord] = {}
        self._broken: dict[int, str] = {}
        self._manifest: Manifest | None = None

    def __repr__(self) -> str:
        return f"RunReader({self.url!r}, records={len(self._records)})"

    async def _get(self, key: str) -> bytes | None:
        return await retrying(lambda: self.mailbox.get(key), attempts=_READ_ATTEMPTS)

    async def _list(self, prefix: str, after: str = "") -> Sequence[str]:
        return await retrying(
            lambda: self.mailbox.list(prefix, after=after), attempts=_READ_ATTEMPTS
        )

    async def manifest(self) -> Manifest:
        """The run's manifest; ``CliError`` when there is no run (or an unreadable one)."""
        if self._manifest is not None:
            return self._manifest
        data = await self._get(keys.MANIFEST)
        if data is None:
            claims = await self._list(keys.CREATE)
            if claims:
                creator = await self._get(claims[-1])
                who = "someone" if creator is None else _creator(creator)
                raise CliError(
                    f"{self.url}: no run yet: {who} is creating one (no manifest written); "
                    "try again in a moment"
                )
            raise CliError(
                f"{self.url}: no run here (no manifest); a run is created by the first node "
                "that joins it, e.g. `gradientmail demo --store URL`"
            )
        try:
            self._manifest = decode(data, Manifest)
        except RecordError as exc:
            raise CliError(f"{self.url}: the run's manifest is unreadable: {exc}") from exc
        return self._manifest

    async def _read_records(self, rounds: Sequence[int]) -> None:
        limiter = anyio.CapacityLimiter(_CONCURRENT_READS)

        async def one(round: int) -> None:
            async with limiter:
                data = await self._get(keys.record(round))
            if data is None:
                self._broken[round] = "listed but gone"
                return
            try:
                self._records[round] = decode(data, RoundRecord)
            except RecordError as exc:
                self._broken[round] = str(exc)

        async with anyio.create_task_group() as group:
            for round in rounds:
                group.start_soon(one, round)

    async def observe(self) -> Observation:
        """Read the manifest (once), new round records, leases and the pending round."""
        manifest = await self.manifest()
        known = max([*self._records, *self._broken], default=-1)
        after = keys.record(known) if known >= 0 else ""
        fresh = [
            round
            for key in await self._list(keys.RECORDS, after)
            if (round := keys.parse_record(key)) is not None
        ]
        await self._read_records(fresh)
        leases: dict[str, tuple[int, int]] = {}
        for key in await self._list(keys.LEASES):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                learner, beat, _ = parsed
                newest, count = leases.get(learner, (-1, 0))
                leases[learner] = (max(newest, beat), count + 1)
        pending = max([*self._records, *self._broken], default=-1) + 1
        snapshots = tuple(
            snapshot[1]
            for key in await self._list(keys.snapshots_prefix(pending))
            if (snapshot := keys.parse_snapshot(key)) is not None
        )
        claims = []
        for key in await self._list(keys.claims_prefix(pending)):
            data = None if keys.parse_claim(key) is None else await self._get(key)
            if data is not None:
                claims.append(_claimant(data))
        problems = tuple(f"record {r}: {why}" for r, why in sorted(self._broken.items()))
        return Observation(
            url=self.url,
            manifest=manifest,
            records=dict(self._records),
            leases=leases,
            pending=pending,
            snapshots=snapshots,
            claims=tuple(claims),
            problems=problems,
        )


def _creator(data: bytes) -> str:
    try:
        return decode(data, CreateClaim).learner
    except RecordError:
        return "someone"


def _claimant(data: bytes) -> str:
    try:
        return decode(data, RoundClaim).learner
    except RecordError:
        return "?"


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
    newest: dict[int, RoundRecord] = {}
    for round in sorted(observation.records):
        record = observation.records[round]
        newest[record.fragment] = record
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
                "theta": (theta0 if latest is None else latest.theta).sha256,
            }
        )
    ordered = [observation.records[r] for r in sorted(observation.records)]
    rounds = [
        {
            "round": record.round,
            "fragment": record.fragment,
            "version": record.version,
            "committed_by": record.committed_by,
            "participants": [msgspec.to_builtins(p) for p in record.participants],
            "rejected": [msgspec.to_builtins(r) for r in record.rejected],
            "quorum_seconds": _finite(record.quorum_seconds),
            "grace_seconds": _finite(record.grace_seconds),
            "cosine": _finite(record.cosine),
        }
        for record in (ordered[-last:] if last > 0 else [])
    ]
    participants = [p for record in ordered for p in record.participants]
    rejected = [r for record in ordered for r in record.rejected]
    tokens_by_fragment = [0] * count
    for record in ordered:
        if 0 <= record.fragment < count:
            tokens_by_fragment[record.fragment] += sum(p.tokens for p in record.participants)
    return {
        "url": observation.url,
        "manifest": {
            "created_by": manifest.created_by,
            "signed": isinstance(manifest.key_id, str),
            "key_id": manifest.key_id if isinstance(manifest.key_id, str) else None,
            "fragments": count,
            "tensors": sum(len(spec.params) for spec in manifest.fragments),
            "parameters": sum(spec.numel for spec in manifest.fragments),
            "config": msgspec.to_builtins(manifest.config),
        },
        "fragments": fragments,
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
                "live": None if live is None else learner in live,
            }
            for learner, (beat, beats) in sorted(observation.leases.items())
        ],
        "totals": {
            "rounds": len(observation.records),
            "snapshots": len(participants),
            "rejected": len(rejected),
            "steps": sum(p.steps for p in participants) / count,
            "tokens": sum(p.tokens for p in participants) / count,
            "rejected_tokens": sum(r.tokens for r in rejected) / count,
            "tokens_by_fragment": tokens_by_fragment,
        },
        "problems": list(observation.problems),
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(doc: Mapping[str, Any]) -> RenderableType:
    """The status document as rich tables (pure: builds renderables, prints nothing)."""
    manifest = doc["manifest"]
    config = " ".join(f"{k}={v}" for k, v in manifest["config"].items())
    head = Text.assemble(
        ("run ", "bold"),
        (doc["url"], "bold cyan"),
        f"  created by {manifest['created_by']}: {manifest['parameters']:,} parameters in "
        f"{manifest['tensors']} tensors, {manifest['fragments']} fragments, "
        + (f"signed (key id {manifest['key_id']})" if manifest["signed"] else "unsigned")
        + "\n",
        ("config ", "dim"),
        config,
    )
    fragments = Table(title="fragments", title_justify="left")
    for column in ("fragment", "tensors", "parameters", "version", "from round", "theta"):
        fragments.add_column(column, justify="left" if column == "theta" else "right")
    for f in doc["fragments"]:
        fragments.add_row(
            str(f["index"]),
            str(f["tensors"]),
            f"{f['parameters']:,}",
            str(f["version"]),
            "Θ⁰" if f["round"] is None else str(f["round"]),
            f["theta"][:12],
        )
    totals = doc["totals"]
    rounds = Table(
        title=f"rounds (newest {len(doc['rounds'])} of {totals['rounds']})", title_justify="left"
    )
    for column in ("round", "frag", "ver"):
        rounds.add_column(column, justify="right")
    rounds.add_column("committed by", no_wrap=True)
    rounds.add_column("participants (weight)", ratio=3)
    rounds.add_column("rejected", ratio=1)
    for column in ("quorum s", "grace s", "cosine"):
        rounds.add_column(column, justify="right")
    for r in doc["rounds"]:
        rounds.add_row(
            str(r["round"]),
            str(r["fragment"]),
            str(r["version"]),
            r["committed_by"],
            " ".join(f"{p['learner']} {p['weight']:.2f}" for p in r["participants"]) or "-",
            ", ".join(f"{x['learner']}: {x['reason']}" for x in r["rejected"]) or "-",
            _seconds(r["quorum_seconds"]),
            _seconds(r["grace_seconds"]),
            "-" if r["cosine"] is None else f"{r['cosine']:.3f}",
        )
    pending = doc["pending"]
    in_flight = Text.assemble(
        ("in flight ", "bold"),
        f"round {pending['round']} (fragment {pending['fragment']}): snapshots from "
        f"{', '.join(pending['snapshots']) or 'nobody yet'}; "
        f"claimed by {', '.join(pending['claims']) or 'nobody yet'}",
    )
    leases = Table(title="leases", title_justify="left")
    for column in ("learner", "newest beat", "beats", "live"):
        leases.add_column(column, justify="left" if column == "learner" else "right")
    for lease in doc["leases"]:
        live = lease["live"]
        leases.add_row(
            lease["learner"],
            str(lease["beat"]),
            str(lease["beats"]),
            "?" if live is None else ("[green]yes[/]" if live else "[red]no[/]"),
        )
    summary = Text(
        f"{totals['rounds']} rounds committed: {totals['snapshots']} snapshots, "
        f"{totals['steps']:,.0f} steps and {totals['tokens']:,.0f} tokens per fragment; "
        f"{totals['rejected']} snapshots rejected ({totals['rejected_tokens']:,.0f} tokens "
        "per fragment)"
    )
    no_leases = Text("leases: none (no node of this run is running)")
    parts: list[RenderableType] = [
        head,
        fragments,
        rounds,
        in_flight,
        leases if doc["leases"] else no_leases,
        summary,
    ]
    parts.extend(Text(f"problem: {p}", style="yellow") for p in doc["problems"])
    return Group(*parts)


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

    Raises ``CliError`` when there is no store or no run, ``MailboxUnavailable`` when the
    store stays out of reach over a few retries.
    """
    out = console if console is not None else Console()
    async with open_store(url, must_exist=True) as mailbox:
        reader = RunReader(mailbox, url)
        if not watch:
            doc = document(await reader.observe(), last=last)
            if as_json:
                print(json.dumps(doc, indent=2))
            else:
                out.print(render(doc))
            return
        clock = MonotonicClock()
        liveness = Liveness(timeout=lease_timeout)
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
                    observation = await reader.observe()
                    now = clock.now()
                    beats = {learner: beat for learner, (beat, _) in observation.leases.items()}
                    liveness = liveness.observed(beats, now)
                    doc = document(observation, last=last, live=liveness.live(now))
                    if view is None:
                        print(json.dumps(doc), flush=True)
                    else:
                        view.update(render(doc), refresh=True)
                    await anyio.sleep(interval)
