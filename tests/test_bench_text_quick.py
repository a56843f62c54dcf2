"""The real-text benchmark's repeat mode at its quick size, end to end: two learner processes
and a syncer on the standard library's text with the plain-SGD inner optimizer, the result
file's per-seed and over-seed figures, and the generated page's section for it.

Results and the page go to a temporary directory. About half a minute on two idle cores.
"""

import json
from pathlib import Path

from bench_helpers import run_benchmark


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
    assert set(row) == {"dp", "single", "gm-defaults"}
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
