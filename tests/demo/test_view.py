"""The demo's board, its notices, the summary and the plot (pure, plus one PNG)."""

import dataclasses
from pathlib import Path

from rich.console import Console

from gradientmail.demo.settings import DemoSettings, Progress
from gradientmail.demo.view import (
    Board,
    EvalPoint,
    line,
    notice,
    plot,
    render_board,
    session_summary,
)


def _board() -> Board:
    return Board(
        settings=DemoSettings(store="somewhere", workdir="somewhere", learners=2),
        parameters=1_000_000,
        floor=1.1,
        unigram=3.9,
        description="a test language",
    )


def _text(renderable: object) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return console.export_text()


def _record(round: int) -> dict[str, object]:
    return {
        "round": round,
        "fragment": round % 2,
        "version": round // 2 + 1,
        "committed_by": "learner-1",
        "participants": [{"learner": "learner-0", "weight": 0.25}],
        "rejected": [{"learner": "learner-1", "reason": "stale"}],
    }


def test_the_board_keeps_the_newest_round_and_the_last_notices() -> None:
    board = _board()
    for round in (3, 5, 4):
        board = board.with_event(
            {"event": "round_committed", "learner": "x", "record": _record(round)}
        )
    assert board.newest is not None
    assert board.newest["round"] == 5
    for k in range(7):
        board = board.with_event(
            {"event": "events_dropped", "learner": "x", "sink": "s", "count": k}
        )
    assert len(board.notices) == 5
    assert board.notices[-1] == "x: 6 events dropped by s"
    assert board.with_event({"event": "snapshot_published", "learner": "x"}) is board


def test_notices_describe_the_notable_events() -> None:
    takeover = {"event": "took_over_round", "learner": "a", "round": 7, "claimants": ["b"],
                "cause": "lease_gone"}  # fmt: skip
    assert notice(takeover) == "a: took over round 7 from b (lease_gone)"
    rejected = notice({"event": "snapshot_rejected", "learner": "a", "round": 2, "reason": "stale",
                       "steps": 8, "tokens": 512})  # fmt: skip
    assert (
        rejected == "a: its snapshot for round 2 was rejected (stale): 8 steps, 512 tokens dropped"
    )
    failed = notice({"event": "round_failed", "learner": "a", "round": 1,
                     "error": {"type": "OSError", "message": "disk full"}})  # fmt: skip
    assert failed == "a: round 1 failed (OSError: disk full); retrying"
    assert notice({"event": "joined", "learner": "a"}) is None


def test_render_line_and_summary_show_the_session() -> None:
    board = _board().with_event({"event": "round_committed", "learner": "x", "record": _record(4)})
    progress = Progress(
        learner="learner-0", pid=1, session=0, phase="training", step=12, steps=40, tokens=768,
        loss=2.5, tokens_per_second=1234.0,
        state={"bytes_published": 3 * 1024 * 1024, "bytes_downloaded": 2048, "rounds_committed": 3},
    )  # fmt: skip
    history = (EvalPoint(0, -1, 4.2, 1.0), EvalPoint(768, 4, 2.0, 9.0))
    board = dataclasses.replace(
        board, progress={"learner-0": progress}, history=history, elapsed=12.0
    )
    live = _text(render_board(board))
    assert "learner-0" in live
    assert "12/40 steps" in live
    assert "1,234 tok/s · loss 2.500" in live
    assert (
        "newest round 4 (fragment 0 v3) by learner-1: learner-0 0.25; rejected: learner-1 (stale)"
        in live
    )
    assert "eval loss 2.000 after 768 committed tokens (start 4.200, floor 1.100)" in live
    assert line(board) == "[  12.0s] learner-0 12/40 loss 2.500 | round 4 | eval loss 2.000"
    table = _text(session_summary(board, rounds=5, plot_path=Path("p.png")))
    for text in ("3.0 MiB", "2.0 KiB", "rounds committed", "4.200", "2.000", "1.100", "3.900",
                 "plot of eval loss against tokens: p.png"):  # fmt: skip
        assert text in table, text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    plot([EvalPoint(0, -1, 4.0, 0.0), EvalPoint(100, 0, 2.0, 1.0)], path, floor=1.0, unigram=3.5)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot([EvalPoint(0, -1, 4.0, 0.0)], path, floor=None, unigram=None)
    assert path.stat().st_size > 1000
