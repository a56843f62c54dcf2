"""The benchmarks' quick variant end to end, one benchmark per test (so that test workers
share them out): each benchmark runs, writes a result file that parses and carries its
figures, and the page generated from it has that benchmark's section and plots. The store
benchmark runs through ``benchmarks/run.py``, whose summary and page are checked there;
which benchmarks a whole quick run makes is checked on ``run.selected``.

Results and the page go to a temporary directory, never to the repository's
``benchmarks/results`` or ``docs``. About a minute in all on two idle cores.
"""

import json
import sys
from pathlib import Path
from typing import Any

from bench_helpers import ROOT, run_benchmark

EXPECTED = ("store", "rounds", "overhead", "convergence", "transfer", "memory")
HEADINGS = {
    "convergence": "## 1. Convergence and bytes",
    "overhead": "## 2. Step overhead",
    "store": "## 3. Store throughput",
    "rounds": "## 4. Round latency and scale",
    "transfer": "## 11. Large transfers",
    "memory": "## 12. Memory and round latency of large fragments",
}
PLOTS = {
    "convergence": ("convergence.png", "bytes.png"),
    "store": ("store.png",),
    "rounds": ("scale.png",),
}


def _benchmarks() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report
    import run

    return run, report


def _figures(results: Path, name: str) -> dict[str, Any]:
    """``name``'s result file, its header checked; its figures."""
    result = json.loads((results / f"{name}.json").read_text(encoding="utf-8"))
    assert result["benchmark"] == name
    assert result["quick"] is True
    assert result["git_commit"]
    assert result["machine"]["cpus"] >= 1
    assert result["versions"]["torch"]
    assert result["figures"], name
    figures: dict[str, Any] = result["figures"]
    return figures


def _check_page(docs: Path, name: str) -> None:
    """The page generated into ``docs`` has ``name``'s section, measured, and its plots."""
    page = (docs / "benchmarks.md").read_text(encoding="utf-8")
    assert "## Targets" in page
    assert "quick variant" in page
    section = page.split(HEADINGS[name])[1].split("\n## ")[0]
    assert "quick variant" in section
    assert "Not measured" not in section
    for plot in PLOTS.get(name, ()):
        data = (docs / "benchmarks" / plot).read_bytes()
        assert data.startswith(b"\x89PNG"), plot


def _quick(name: str, tmp_path: Path) -> dict[str, Any]:
    """Run benchmark ``name`` at its quick size, generate the page from its result and check
    both; its figures."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    run_benchmark(f"bench_{name}.py", "--quick", "--results", str(results), timeout=300)
    figures = _figures(results, name)
    _, report = _benchmarks()
    report.generate(results, docs)
    _check_page(docs, name)
    return figures


def test_a_quick_run_makes_every_benchmark_but_the_long_ones(tmp_path: Path) -> None:
    run, _ = _benchmarks()
    assert run.selected(None, True, tmp_path) == list(EXPECTED)
    assert run.selected(None, False, tmp_path) == [
        *EXPECTED[:4],
        "transfer",
        "memory",
        "convergence-bytes",
        "rejoin",
    ]
    assert "events" in run.selected(None, True, ROOT / "benchmarks" / "results")
    assert run.selected(["rejoin", "events"], True, tmp_path) == ["rejoin"]


def test_store_through_the_runner_which_sums_it_up(tmp_path: Path) -> None:
    results, docs = tmp_path / "results", tmp_path / "docs"
    run_benchmark(
        "run.py",
        *("--quick", "--only", "store", "--results", str(results), "--docs", str(docs)),
        timeout=300,
    )
    run = json.loads((results / "run.json").read_text(encoding="utf-8"))
    assert run["quick"] is True
    assert run["figures"]["failed"] == []
    assert set(run["figures"]["seconds"]) == {"store"}
    store = _figures(results, "store")
    for backend in ("asyncio", "trio"):
        for kind in ("local", "s3"):
            assert store[backend][kind]["list"]["ratio"] > 0
    _check_page(docs, "store")
    assert "The quick run" in (docs / "benchmarks.md").read_text(encoding="utf-8")


def test_convergence_measures_the_bytes_and_rounds_of_every_arm(tmp_path: Path) -> None:
    convergence = _quick("convergence", tmp_path)["arms"]
    assert {"dp", "single"} <= set(convergence)
    gm = [arm for arm in convergence if arm.startswith("gm-")]
    assert gm
    for arm in gm:
        assert convergence[arm]["bytes_per_learner"]["median"] > 0
        assert convergence[arm]["rounds_committed"]["median"] > 0


def test_rounds_requests_per_round_grow_with_the_learners(tmp_path: Path) -> None:
    scale = _quick("rounds", tmp_path)["scale"]
    assert all(entry["rounds"] > 0 for entry in scale["by_n"].values())
    kept = [int(n) for n, entry in scale["by_n"].items() if entry["kept_pace"]]
    if len(kept) >= 2:
        assert scale["fit_ns"] == kept
        assert scale["fit"]["slope"] > 0
    else:
        assert "fit" not in scale


def test_overhead_measures_steps_rounds_and_the_idle_cost(tmp_path: Path) -> None:
    overhead = _quick("overhead", tmp_path)
    assert overhead["steps_per_s_node"]["median"] > 0
    assert overhead["rounds_committed"] > 0
    assert all(idle["learner_core_percent"] > 0 for idle in overhead["idle"].values())


def test_transfer_takes_the_parallel_paths_at_its_quick_size(tmp_path: Path) -> None:
    transfer = _quick("transfer", tmp_path)
    for backend in ("asyncio", "trio"):
        for kind in ("local", "s3"):
            for op in ("put", "get"):
                assert transfer[backend][kind][op]["ratio_vs_raw"] > 0
        # The quick blob still takes the parallel paths: several parts, several chunks.
        s3, local = transfer[backend]["s3"], transfer[backend]["local"]
        size = json.loads((tmp_path / "results" / "transfer.json").read_text())["parameters"][
            "size_bytes"
        ]
        assert size > s3["multipart_threshold"]
        assert size > 2 * s3["part_size"]
        assert size > 2 * local["write_chunk"]


def test_memory_grows_with_the_fragment_and_rounds_have_a_latency(tmp_path: Path) -> None:
    memory = _quick("memory", tmp_path)
    for role in ("publish", "close"):
        assert memory["memory"][role]["fit_above_start"]["slope"] > 0
    assert len(memory["latency"]["values_s"]) >= 2
    assert all(value > 0 for value in memory["latency"]["values_s"])
