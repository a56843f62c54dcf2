"""The learner-groups benchmark at its quick size, end to end: a learner of two DDP ranks, one
of two FSDP2 ranks and one of one process train the demo's model, an arm each; the result
file's per-rank figures, and the generated page's section for them.

Results and the page go to a temporary directory. About half a minute on two idle cores.
"""

import json
import math
from pathlib import Path

from bench_helpers import run_benchmark


def test_every_arm_is_measured_per_rank_and_the_page_shows_it(tmp_path: Path) -> None:
    results, docs = tmp_path / "results", tmp_path / "docs"
    run_benchmark("bench_groups.py", "--quick", "--results", str(results))
    figures = json.loads((results / "groups.json").read_text(encoding="utf-8"))["figures"]
    for arm in ("group", "fsdp", "single"):
        assert figures[f"{arm}_rounds"] > 0
        assert math.isfinite(figures[f"{arm}_eval_loss"]["median"])
    single = figures["single_leader"]
    for role in ("leader", "follower"):
        sharded = figures[f"fsdp_{role}"]
        # Each rank holds and uploads its half of the learner's parameters and snapshots.
        assert sharded["param_bytes"] * 2 == single["param_bytes"]
        assert 0.45 < figures[f"fsdp_{role}_snapshot_up_ratio"] < 0.55
        assert sharded["store_down"] > 0
        assert sharded["peak_rss_bytes"] > 0
    # A DDP follower never touches the store; the leader uploads what a single learner does.
    assert figures["group_follower"]["store_up"] == figures["group_follower"]["store_down"] == 0
    assert 0.9 < figures["group_leader"]["snapshot_bytes"] / single["snapshot_bytes"] < 1.1
    assert figures["fsdp_leader"]["publish_s_median"] > 0

    run_benchmark("report.py", "--results", str(results), "--docs", str(docs))
    section = (docs / "benchmarks.md").read_text(encoding="utf-8").split("## 9. Learner groups")[1]
    section = section.split("\n## ")[0]
    assert "FSDP2: rank 1" in section
    assert "In the *fsdp* arm" in section
