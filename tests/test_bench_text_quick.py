"""The real-text benchmark's repeat and timing modes at their quick size, end to end: two
learner processes and a syncer on the standard library's text with the plain-SGD inner
optimizer, the result file's per-seed and over-seed figures, and the generated page's
section for it; the fp32 pair run in both orders, and the wall target judged on it; the
rerun mode's rows and the spread of excesses that share a sign.

Results and the page go to a temporary directory. About half a minute each on two idle
cores.
"""

import json
import sys
from pathlib import Path

import pytest
from bench_helpers import ROOT, run_benchmark

from gradientmail.protocol.records import RunConfig


def test_repeat_mode_measures_every_arm_and_the_page_shows_it(tmp_path: Path) -> None:
    results, docs = tmp_path / "results", tmp_path / "docs"
    run_benchmark(
        "bench_text.py",
        *("--size", "quick", "--mode", "repeat", "--seeds", "0", "--results", str(results)),
    )
    result = json.loads((results / "text-repeat-quick.json").read_text(encoding="utf-8"))
    assert result["parameters"]["learners"] == 2
    assert result["parameters"]["inner"] == "sgd"
    row = result["figures"]["per_seed"]["0"]
    assert set(row) == {"dp", "single", "gm-defaults", "gm-unpaced", "gm-overlap-5"}
    runs = result["figures"]["arms"]["0"]
    assert runs["gm-overlap-5"]["config"]["overlap"] == 5
    assert runs["gm-unpaced"]["config"]["overlap"] is None
    gm = row["gm-defaults"]
    assert gm["rounds_committed"] > 0
    assert isinstance(gm["beats_single"], bool)
    assert gm["excess_over_dp"] == gm["bits_per_byte"] - row["dp"]["bits_per_byte"]
    config = result["figures"]["arms"]["0"]["gm-defaults"]["config"]
    defaults = result["parameters"]["defaults"]
    assert config == defaults
    assert result["figures"]["over_seeds"]["gm-defaults"]["runs"] == 1

    run_benchmark("report.py", "--results", str(results), "--docs", str(docs))
    page = (docs / "benchmarks.md").read_text(encoding="utf-8")
    section = page.split("## 8. Real text over seeds")[1]
    assert "Repeatability" in section
    assert "runs below single" in section
    assert "spread of the excess over DP" in page.split("## 1.")[0]
    assert "with overlap 5, spread of the excess over DP" in page.split("## 1.")[0]
    unpaced = RunConfig(overlap=None)
    assert (
        f"`gm-unpaced`: F={unpaced.fragments} (`{unpaced.pattern}`), H={unpaced.sync_every}, "
        f"outer {unpaced.outer_lr} / {unpaced.outer_momentum}, quorum "
        f"{unpaced.quorum_fraction} / grace {unpaced.grace} s, unpaced"
    ) in section


def test_timing_mode_runs_each_pair_in_both_orders_and_the_page_judges_on_it(
    tmp_path: Path,
) -> None:
    # torchft is the bench extra's (a benchmark dependency only), not the dev install's.
    pytest.importorskip("torchft")
    results = tmp_path / "results"
    run_benchmark(
        "bench_text.py", *("--size", "quick", "--mode", "timing", "--results", str(results))
    )
    timing = json.loads((results / "text-timing-quick.json").read_text(encoding="utf-8"))
    assert timing["parameters"]["order"] == ["gm", "torchft", "torchft", "gm"]
    pair = timing["figures"]["pairs"]["10"]
    gm, ft = pair["gm"], pair["torchft"]
    assert len(gm) == len(ft) == 2
    assert all(run["wall_seconds"] > 0 and run["bits_per_byte"] > 0 for run in gm + ft)
    assert pair["wall_ratio"] == (gm[0]["wall_seconds"] + gm[1]["wall_seconds"]) / (
        ft[0]["wall_seconds"] + ft[1]["wall_seconds"]
    )
    assert pair["wall_ratio_gm_first"] == gm[0]["wall_seconds"] / ft[0]["wall_seconds"]
    assert pair["wall_ratio_torchft_first"] == gm[1]["wall_seconds"] / ft[1]["wall_seconds"]

    # The page judges the wall target on both orders, not on the matrix's own pair (given
    # here as 2.0 so that the two verdicts differ whenever the pairs' ratio is at most 1).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    page = report.Page(tmp_path / "docs")
    versus = {
        "10": {
            "bits_per_byte_ratio": 1.0,
            "excess_over_dp": [0.1, 0.2],
            "wall_ratio": 2.0,
            "train_ratio": 2.0,
            "cpu_ratio": 2.0,
            "bytes_ratio": 1.5,
        }
    }
    report._text_versus(page, versus, "quick", timing)
    report._text_timing(page, timing)
    wall = next(row for row in page.targets if "wall time" in row[0])
    assert wall[2].startswith(f"{pair['wall_ratio']:.3f} (each pair in both orders")
    assert "the matrix's own pair 2.00" in wall[2]
    assert wall[3] == report._verdict(pair["wall_ratio"] <= 1.0)
    text = "\n".join(page.lines)
    assert "Wall time with each fp32 pair run in both orders (gm, torchft, torchft, gm)" in text
    assert f"| 10 | {gm[0]['wall_seconds']:.0f}, {gm[1]['wall_seconds']:.0f} |" in text


def test_rerun_rows_and_the_spread_of_excesses_that_share_a_sign() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_text_seeds as seeds

    rerun = seeds.MODES["rerun"]
    assert seeds.rows(rerun) == [(f"0#{n}", 0) for n in range(1, seeds.RERUNS + 1)]
    assert seeds.rows(seeds.MODES["repeat"]) == [(str(s), s) for s in range(5)]
    assert seeds.config("gm-overlap-5") == RunConfig(overlap=5)
    assert seeds.config("gm-defaults") == RunConfig()
    assert seeds.config("gm-unpaced") == RunConfig(overlap=None)

    def arms(gm: float) -> dict[str, dict[str, float]]:
        return {"dp": {"bits_per_byte": 3.0, "wall_seconds": 1.0}} | {
            "gm-defaults": {"bits_per_byte": gm, "wall_seconds": 1.0}
        }

    below = seeds.figures({"0#1": arms(2.96), "0#2": arms(2.98)})["over_seeds"]["gm-defaults"]
    assert below["excess_spread"] == pytest.approx(2.0)
    across = seeds.figures({"0#1": arms(2.96), "0#2": arms(3.02)})["over_seeds"]["gm-defaults"]
    assert across["excess_spread"] is None

    import report

    assert sorted(["0#10", "1#1", "0#2"], key=report._row_order) == ["0#2", "0#10", "1#1"]
    assert report._row_order("3") == (3, 0)
