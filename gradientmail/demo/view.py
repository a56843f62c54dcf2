"""What the demo shows: the live board, plain progress lines, the summary table and the plot.

``Board`` is the runner's picture of the session, an immutable value replaced as news
arrives: learners' progress (from their progress files), the newest committed round and
notable events (from their JSON event files), and the evaluation history. Everything here
is pure except ``plot``, which writes a PNG.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gradientmail.demo.settings import DemoSettings, Progress

__all__ = ["Board", "EvalPoint", "line", "notice", "plot", "render_board", "session_summary"]

_NOTICES = 5


@dataclass(frozen=True, slots=True)
class EvalPoint:
    """The global model's evaluation ``loss`` after ``round`` (-1: Θ⁰), when the run had
    committed ``tokens`` tokens, ``seconds`` into the session that measured it."""

    tokens: int
    round: int
    loss: float
    seconds: float


@dataclass(frozen=True, slots=True)
class Board:
    """The session as the runner knows it."""

    settings: DemoSettings
    parameters: int
    floor: float | None
    unigram: float | None
    description: str
    progress: Mapping[str, Progress] = field(default_factory=dict)
    newest: Mapping[str, Any] | None = None
    notices: tuple[str, ...] = ()
    history: tuple[EvalPoint, ...] = ()
    elapsed: float = 0.0

    def with_event(self, event: Mapping[str, Any]) -> "Board":
        """Fold one parsed JSON event line in."""
        kind = event.get("event")
        record = event.get("record")
        if kind in ("round_committed", "round_recorded") and isinstance(record, dict):
            if self.newest is None or record.get("round", -1) > self.newest.get("round", -1):
                return dataclasses.replace(self, newest=record)
            return self
        text = notice(event)
        if text is None:
            return self
        return dataclasses.replace(self, notices=(*self.notices, text)[-_NOTICES:])


def _error(value: object) -> str:
    if isinstance(value, dict):
        return f"{value.get('type', 'error')}: {value.get('message', '')}"
    return str(value)


def notice(event: Mapping[str, Any]) -> str | None:
    """A one-line description of a notable event (a JSON event line), or None for the
    routine ones the board shows otherwise."""
    get = event.get
    match get("event"):
        case "took_over_round":
            claimants = ", ".join(map(str, get("claimants") or ())) or "nobody"
            text = f"took over round {get('round')} from {claimants} ({get('cause')})"
        case "took_over_creation":
            text = f"took over creating the run (stalled {get('stalled')} s)"
        case "snapshot_rejected":
            text = (
                f"its snapshot for round {get('round')} was rejected ({get('reason')}): "
                f"{get('steps')} steps, {get('tokens')} tokens dropped"
            )
        case "steps_dropped":
            text = f"{get('steps')} steps of fragment {get('fragment')} dropped ({get('reason')})"
        case "gave_up":
            text = f"gave up waiting for round {get('round')} after {get('waited')} s"
        case "round_failed":
            text = f"round {get('round')} failed ({_error(get('error'))}); retrying"
        case "syncer_stopped":
            text = f"syncer stopped: {_error(get('error'))}"
        case "publish_failed":
            text = f"publishing for round {get('round')} failed: {_error(get('error'))}"
        case "poll_failed":
            text = f"polling the store failed: {_error(get('error'))}"
        case "events_dropped":
            text = f"{get('count')} events dropped by {get('sink')}"
        case _:
            return None
    return f"{get('learner', '?')}: {text}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _round_text(newest: Mapping[str, Any] | None) -> Text:
    if newest is None:
        return Text("no round committed yet", style="dim")
    participants = ", ".join(
        f"{p.get('learner')} {p.get('weight', 0):.2f}" for p in newest.get("participants", [])
    )
    rejected = ", ".join(
        f"{r.get('learner')} ({r.get('reason')})" for r in newest.get("rejected", [])
    )
    return Text.assemble(
        ("newest round ", "bold"),
        f"{newest.get('round')} (fragment {newest.get('fragment')} v{newest.get('version')}) "
        f"by {newest.get('committed_by')}: {participants or 'no participants'}; "
        f"rejected: {rejected or 'none'}",
    )


def _eval_text(board: Board) -> Text:
    if not board.history:
        return Text("global model: not evaluated yet", style="dim")
    last = board.history[-1]
    return Text.assemble(
        ("global model ", "bold"),
        f"eval loss {last.loss:.3f} after {last.tokens:,} committed tokens "
        f"(start {board.history[0].loss:.3f}, floor {_loss(board.floor)})",
    )


def render_board(board: Board) -> RenderableType:
    """The live board: a bar per learner, the newest round, the global model, notices."""
    s = board.settings
    head = Text.assemble(
        ("gradientmail demo ", "bold"),
        f"· store {s.store} · {s.learners} learners · {board.parameters:,} parameters · "
        f"{board.description} · {board.elapsed:.0f}s",
    )
    table = Table.grid(padding=(0, 2))
    for _ in range(5):
        table.add_column()
    for name in sorted(board.progress):
        p = board.progress[name]
        table.add_row(
            name,
            ProgressBar(total=max(p.steps, 1), completed=p.step, width=30),
            f"{p.step}/{p.steps} steps",
            f"{p.tokens_per_second:,.0f} tok/s · loss {_loss(p.loss)}",
            p.phase,
        )
    parts: list[RenderableType] = [head, table, _round_text(board.newest), _eval_text(board)]
    parts.extend(Text(n, style="yellow") for n in board.notices)
    return Group(*parts)


def line(board: Board) -> str:
    """One plain progress line (for output that is not a terminal)."""
    learners = " ".join(
        f"{name} {p.step}/{p.steps} loss {_loss(p.loss)}"
        for name, p in sorted(board.progress.items())
    )
    round_ = "-" if board.newest is None else board.newest.get("round")
    loss = "-" if not board.history else f"{board.history[-1].loss:.3f}"
    return f"[{board.elapsed:6.1f}s] {learners} | round {round_} | eval loss {loss}"


def session_summary(board: Board, rounds: int, plot_path: Path | None) -> RenderableType:
    """The end-of-session table: per learner, then the run's rounds and losses."""
    learners = Table(title="learners", title_justify="left")
    for column in ("learner", "phase", "steps", "tokens", "published", "downloaded", "commits"):
        learners.add_column(column, justify="left" if column in ("learner", "phase") else "right")
    for name in sorted(board.progress):
        p = board.progress[name]
        state = p.state or {}
        learners.add_row(
            name,
            p.phase,
            f"{p.step:,}",
            f"{p.tokens:,}",
            _bytes(state.get("bytes_published")),
            _bytes(state.get("bytes_downloaded")),
            str(state.get("rounds_committed", "-")),
        )
    run = Table(title="run", title_justify="left", show_header=False)
    run.add_column(justify="left")
    run.add_column(justify="right")
    run.add_row("rounds committed", str(rounds))
    run.add_row("wall time", f"{board.elapsed:.1f} s")
    if board.history:
        run.add_row("eval loss at start (nats)", f"{board.history[0].loss:.3f}")
        run.add_row("eval loss of the final global model", f"{board.history[-1].loss:.3f}")
    if board.unigram is not None:
        run.add_row("unigram entropy (no context)", f"{board.unigram:.3f}")
    if board.floor is not None:
        run.add_row("entropy floor (exact)", f"{board.floor:.3f}")
    parts: list[RenderableType] = [learners, run]
    if plot_path is not None:
        parts.append(Text(f"plot of eval loss against tokens: {plot_path}"))
    return Group(*parts)


def _bytes(value: object) -> str:
    if not isinstance(value, int):
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"  # pragma: no cover


def plot(
    history: Sequence[EvalPoint], path: Path, *, floor: float | None, unigram: float | None
) -> None:
    """Write a PNG of evaluation loss against committed tokens, with the floor and the
    unigram entropy as horizontal lines when known. Uses matplotlib's Agg backend through
    its object API (no global pyplot state), so it is safe off the main thread."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(
        [p.tokens for p in history],
        [p.loss for p in history],
        marker="o",
        markersize=3,
        label="global model (eval)",
    )
    if floor is not None:
        axes.axhline(floor, color="green", linestyle="--", label=f"entropy floor {floor:.3f}")
    if unigram is not None:
        axes.axhline(unigram, color="grey", linestyle=":", label=f"unigram entropy {unigram:.3f}")
    axes.set_xlabel("tokens committed (all learners)")
    axes.set_ylabel("cross-entropy (nats per token)")
    axes.set_title("gradientmail demo: evaluation loss of the committed model")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(str(path))
