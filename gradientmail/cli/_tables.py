"""The tables of ``status`` at a terminal's width, down to 80 columns (pure: renderables,
nothing printed). No header, id or time wraps: a header or an id broken over two lines
reads as two (``parti`` / ``cipan`` / ``ts``), so columns keep their content whole and a
round keeps to one line; what gives way in a narrow terminal is the one free-text cell
(the weights of many learners), cut with ``…``; ``--json`` has everything.
"""

import datetime
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

__all__ = ["column_of", "in_flight_line", "rounds_table", "table"]

_WIDTH = 80
"""The width the rounds table is laid out for: each learner gets a weight column of its own
when they fit in it beside the round's time and figures; else they share one ``weights``
column, cut in a narrow terminal."""
_GAP = 2
"""Columns between two columns of a table (a space of padding and the rule's space)."""


def table(title: str) -> Table:
    """A table of plain rules whose columns are two spaces apart."""
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False
    )


def column_of(table: Table, header: str, justify: JustifyMethod) -> None:
    """A column whose header and cells never wrap."""
    table.add_column(header, justify=justify, no_wrap=True, min_width=len(header))


def _clock(closed_at: float | None) -> str:
    if closed_at is None:
        return "-"
    return datetime.datetime.fromtimestamp(closed_at, datetime.UTC).strftime("%H:%M:%S")


def _when(closed_at: float) -> str:
    moment = datetime.datetime.fromtimestamp(closed_at, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _weight(participants: list[dict[str, Any]], learner: str, last: str | None) -> str:
    weights = [p["weight"] for p in participants if p["learner"] == learner]
    if not weights:
        return "-"
    return f"{sum(weights):.2f}" + ("*" if learner == last else "")


def rounds_table(doc: Mapping[str, Any]) -> Table:
    """The newest rounds, one line each: when each closed (UTC), each learner's weight in a
    column of its own (``*``: the learner that came last), rejections, cosine, spread; and
    the fragment and who closed it where they fit in 80 columns with the learners'."""
    rounds = doc["rounds"]
    learners = sorted({p["learner"] for r in rounds for p in r["participants"]})
    closers = max((len(r["committed_by"]) for r in rounds), default=2)
    base = 5 + 8 + 3 + 6 + 8 + 5 * _GAP + max(sum(max(len(n), 5) + _GAP for n in learners), 0)
    apart = base <= _WIDTH
    frag = apart and base + 4 + _GAP <= _WIDTH
    by = apart and base + (4 + _GAP) * frag + max(closers, 2) + _GAP <= _WIDTH
    marked = any(r["last_in"] is not None for r in rounds)
    title = f"rounds (newest {len(rounds)} of {doc['totals']['rounds']}; times UTC"
    table_ = table(title + ("; * came last)" if marked else ")"))
    column_of(table_, "round", "right")
    if frag or not apart:
        column_of(table_, "frag", "right")
    column_of(table_, "closed", "left")
    if by or not apart:
        column_of(table_, "by", "left")
    if apart:
        for name in learners:
            column_of(table_, name, "right")
    else:
        table_.add_column("weights", min_width=12)
    for header in ("rej", "cosine", "spread s"):
        column_of(table_, header, "right")
    for r in rounds:
        weights: list[str | Text]
        if apart:
            weights = [_weight(r["participants"], name, r["last_in"]) for name in learners]
        else:
            text = " ".join(
                f"{p['learner']} {_weight(r['participants'], p['learner'], r['last_in'])}"
                for p in r["participants"]
            )
            weights = [Text(text or "-", no_wrap=True, overflow="ellipsis")]
        table_.add_row(
            str(r["round"]),
            *([str(r["fragment"])] if frag or not apart else []),
            _clock(r["closed_at"]),
            *([r["committed_by"]] if by or not apart else []),
            *weights,
            str(len(r["rejected"])) if r["rejected"] else "-",
            "-" if r["cosine"] is None else f"{r['cosine']:.3f}",
            "-" if r["spread_seconds"] is None else f"{r['spread_seconds']:.2f}",
        )
    return table_


def in_flight_line(doc: Mapping[str, Any]) -> Text:
    """The open round, or for a finished run (no node holds a lease) that it is finished,
    when its newest round committed, and what an unfinished round left behind."""
    pending = doc["pending"]
    left = (
        f"snapshots from {', '.join(pending['snapshots']) or 'nobody'}; "
        f"claimed by {', '.join(pending['claims']) or 'nobody'}"
    )
    if not doc["finished"]:
        return Text.assemble(
            ("in flight ", "bold"),
            f"round {pending['round']} (fragment {pending['fragment']}): "
            + left.replace("nobody", "nobody yet"),
        )
    newest = doc["rounds"][-1] if doc["rounds"] else None
    when = (
        "" if newest is None or newest["closed_at"] is None else f" at {_when(newest['closed_at'])}"
    )
    text = Text.assemble(
        ("finished ", "bold green"),
        "no node of this run is running; "
        + ("no round committed" if newest is None else f"round {newest['round']} committed{when}"),
    )
    if pending["snapshots"] or pending["claims"]:
        text.append(f"; round {pending['round']} was left unfinished ({left})")
    return text
