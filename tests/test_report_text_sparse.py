"""docs/benchmarks.md's ``topk`` targets (``benchmarks/report_text_sparse.py``) from results of
known figures: which arm each target takes and its verdict."""

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _page  # noqa: E402
import report_text_sparse  # noqa: E402

DP = 6_000_000_000.0
PARAMS = 1_000_000


def arm(bits: float, per_learner: float, syncer: float = 0.0, peak: float = 0.0) -> dict[str, Any]:
    return {
        "bits_per_byte": bits,
        "bytes_per_learner": per_learner,
        "syncer_bytes": syncer,
        "peak_store_bytes": peak,
    }


def result(**arms: dict[str, Any]) -> dict[str, Any]:
    every = {"dp": {"bytes_per_learner": DP}, "gm-int8-H50": {"bits_per_byte": 2.0}} | {
        name.replace("_", "-"): run for name, run in arms.items()
    }
    return {"parameters": {"learners": 4, "params": PARAMS}, "figures": {"arms": every}}


def verdicts(tmp_path: Path, found: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each target's ``(what, measured, verdict)``."""
    page = _page.Page(tmp_path)
    report_text_sparse.targets(page, found)
    return [(row[0], row[2], row[3]) for row in page.targets]


def one(rows: list[tuple[str, str, str]], part: str) -> tuple[str, str]:
    """The measured figure and verdict of the one target whose name holds ``part``."""
    (found,) = [(measured, verdict) for what, measured, verdict in rows if part in what]
    return found


def test_the_bytes_at_h50_count_only_an_arm_no_worse_than_int8(tmp_path: Path) -> None:
    found = result(
        gm_topk1_H50=arm(2.1, DP / 2500, peak=8e6), gm_topk3_H50=arm(1.9, DP / 1500, peak=8e6)
    )
    measured, verdict = one(verdicts(tmp_path, found), "≤ int8's")
    assert measured == "topk3 1,500× at 1.9000, topk1 2,500× at 2.1000 (int8 2.0000)"
    assert verdict == "**missed**"
    found["figures"]["arms"]["gm-topk1-H50"]["bits_per_byte"] = 2.0
    assert one(verdicts(tmp_path, found), "≤ int8's")[1] == "met"


def test_the_syncer_share_h100_and_peak_storage(tmp_path: Path) -> None:
    found = result(
        gm_topk1_H50=arm(2.0, DP / 2500, syncer=4 * DP / 2000, peak=13e6),
        gm_topk1_H100=arm(2.2, DP / 3100, peak=7e6),
    )
    rows = verdicts(tmp_path, found)
    assert one(rows, "H=100") == ("3,100×", "met")
    assert one(rows, "syncer's share") == ("1,111×", "met")
    assert one(rows, "peak storage") == ("3.25", "**missed**")


def test_no_topk_arm_no_target(tmp_path: Path) -> None:
    assert verdicts(tmp_path, result()) == []
