"""The report's page: a report document (``report.content``) drawn as one HTML file whose
figures are PNGs inline (``data:`` URIs, drawn by matplotlib without pyplot's global state)
and which loads nothing else: no script, no stylesheet, no font, no URL. Every string from
the run is escaped. Pure: builds a string, touches no file.
"""

import base64
import datetime
import html
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["page"]

_STYLE = """
body { font-family: sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: right; }
th { text-align: left; }
table.run td { text-align: left; }
img { max-width: 100%; }
.note { color: #666; font-style: italic; }
"""


def _png(draw: Callable[[Axes], None], height: float = 3.2) -> str:
    figure = Figure(figsize=(9, height), dpi=90, layout="constrained")
    draw(figure.subplots())
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="" src="data:image/png;base64,{data}">'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _progress(doc: Mapping[str, Any]) -> str:
    points = doc["progress"]
    if not points:
        return _note("The run recorded no evaluations of the shared model (eval.jsonl).")
    axis = "tokens" if all("tokens" in p for p in points) else "round"
    points = [p for p in points if axis in p]

    def draw(ax: Axes) -> None:
        ax.plot([p[axis] for p in points], [p["loss"] for p in points], marker=".")
        ax.set_xlabel(axis)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)

    return _png(draw)


def _times(doc: Mapping[str, Any]) -> str:
    timed = [r for r in doc["rounds"] if r["closed_at"] is not None]
    if not timed:
        return _note("The rounds' records carry no time.")
    start = min(r["closed_at"] for r in timed)
    first = datetime.datetime.fromtimestamp(start, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    span = max(r["closed_at"] for r in timed) - start
    unit, scale = ("minutes", 60.0) if span > 120 else ("seconds", 1.0)

    def draw(ax: Axes) -> None:
        for fragment in sorted({r["fragment"] for r in timed}):
            mine = [r for r in timed if r["fragment"] == fragment]
            since = [(r["closed_at"] - start) / scale for r in mine]
            ax.plot(since, [r["round"] for r in mine], ".", label=f"fragment {fragment}")
        ax.set_xlabel(f"{unit} since the first round closed ({first} UTC)")
        ax.set_ylabel("round")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)

    return _png(draw)


def _weights(doc: Mapping[str, Any]) -> str:
    rounds, learners = doc["rounds"], list(doc["learners"])
    if not rounds:
        return _note("No round has committed.")

    def draw(ax: Axes) -> None:
        below = [0.0] * len(rounds)
        for learner in learners:
            weights = [
                sum(p["weight"] for p in r["participants"] if p["learner"] == learner)
                for r in rounds
            ]
            ax.bar([r["round"] for r in rounds], weights, bottom=below, label=learner, width=1)
            below = [b + w for b, w in zip(below, weights, strict=True)]
        ax.set_xlabel("round")
        ax.set_ylabel("weight in the round")
        ax.legend(fontsize="small", ncols=min(len(learners), 6) or 1)

    return _png(draw)


def _learners(doc: Mapping[str, Any]) -> str:
    learners = doc["learners"]
    parts = []
    if any(info["waited"] for info in learners.values()):

        def waited(ax: Axes) -> None:
            for name, info in learners.items():
                if info["waited"]:
                    ax.plot(*zip(*info["waited"], strict=True), ".-", label=name)
            ax.set_xlabel("round")
            ax.set_ylabel("share of time waiting")
            ax.legend(fontsize="small")
            ax.grid(alpha=0.3)

        parts.append(_png(waited, 2.8))
    else:
        parts.append(_note("The records state no learner's waiting."))
    if any(info["published"] for info in learners.values()):

        def published(ax: Axes) -> None:
            for name, info in learners.items():
                total, xs, ys = 0, [], []
                for round, size in info["published"]:
                    total += size
                    xs.append(round)
                    ys.append(total / 1e6)
                if xs:
                    ax.plot(xs, ys, ".-", label=name)
            ax.set_xlabel("round")
            ax.set_ylabel("MB of deltas published")
            ax.legend(fontsize="small")
            ax.grid(alpha=0.3)

        parts.append(_png(published, 2.8))
    else:
        parts.append(_note("No event log of the learners (events/*.jsonl) was found."))
    return "\n".join(parts)


def _fragments(doc: Mapping[str, Any]) -> str:
    fragments = doc["fragments"]
    total = sum(f["parameters"] for f in fragments) or 1

    def draw(ax: Axes) -> None:
        ax.bar([str(f["index"]) for f in fragments], [f["parameters"] for f in fragments])
        ax.set_xlabel("fragment")
        ax.set_ylabel("parameters")

    rows = "".join(
        f"<tr><td>{f['index']}</td><td>{f['parameters']:,}</td>"
        f"<td>{f['parameters'] / total:.1%}</td><td>{f['tensors']}</td><td>{f['split']}</td></tr>"
        for f in fragments
    )
    table = (
        "<table><tr><th>fragment</th><th>parameters</th><th>share</th><th>tensors</th>"
        f"<th>of them parts of a split tensor</th></tr>{rows}</table>"
    )
    return _png(draw, 2.4) + table


def _table(rows: Sequence[tuple[str, object]]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
    )
    return f'<table class="run">{cells}</table>'


def page(doc: Mapping[str, Any]) -> str:
    """The HTML page of report document ``doc``."""
    state = "finished (no node holds a lease)" if doc["finished"] else "running"
    head = _table(
        [
            ("run", doc["url"]),
            ("created by", doc["created_by"]),
            ("state", state),
            ("rounds committed", len(doc["rounds"])),
            ("learners", ", ".join(doc["learners"]) or "none"),
            ("config", " ".join(f"{k}={v}" for k, v in doc["config"].items())),
        ]
    )
    warnings = "".join(_note(f"problem: {p}") for p in doc["problems"])
    if not doc["verified"]:
        warnings = _note("UNVERIFIED: a signed run read without its key.") + warnings
    sections = [
        ("The shared model", _progress(doc)),
        ("Rounds over time", _times(doc)),
        ("Participants and weights per round", _weights(doc)),
        ("Learners: waiting and bytes", _learners(doc)),
        ("The fragment split", _fragments(doc)),
    ]
    body = "\n".join(f"<h2>{html.escape(title)}</h2>\n{part}" for title, part in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>gradientmail report: {html.escape(doc['url'])}</title>"
        f"<style>{_STYLE}</style></head>\n<body>\n<h1>gradientmail run report</h1>\n"
        f"{head}\n{warnings}\n{body}\n</body></html>\n"
    )
