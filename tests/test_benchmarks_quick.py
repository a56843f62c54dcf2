"""The benchmarks' quick variant end to end: every benchmark runs, writes a result file that
parses and carries its figures, and the generated page and plots exist.

Results and the page go to a temporary directory, never to the repository's
``benchmarks/results`` or ``docs``. About two minutes on two idle cores.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ("store", "rounds", "overhead", "convergence", "transfer", "memory")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    base = tmp_path_factory.mktemp("bench")
    results, docs = base / "results", base / "docs"
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            "--quick",
            "--results",
            str(results),
            "--docs",
            str(docs),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-6000:]
    return results, docs, output


def test_every_result_file_parses_with_its_figures(quick_run: tuple[Path, Path, str]) -> None:
    results, _, _ = quick_run
    for name in EXPECTED:
        result = json.loads((results / f"{name}.json").read_text(encoding="utf-8"))
        assert result["benchmark"] == name
        assert result["quick"] is True
        assert result["git_commit"]
        assert result["machine"]["cpus"] >= 1
        assert result["versions"]["torch"]
        assert result["figures"], name
    run = json.loads((results / "run.json").read_text(encoding="utf-8"))
    assert run["figures"]["failed"] == []
    assert set(run["figures"]["seconds"]) == set(EXPECTED)


def test_the_figures_are_measured_not_empty(quick_run: tuple[Path, Path, str]) -> None:
    results, _, _ = quick_run

    def load(name: str) -> dict:  # type: ignore[type-arg]
        return json.loads((results / f"{name}.json").read_text(encoding="utf-8"))["figures"]  # type: ignore[no-any-return]

    convergence = load("convergence")["arms"]
    assert {"dp", "single"} <= set(convergence)
    gm = [arm for arm in convergence if arm.startswith("gm-")]
    assert gm
    for arm in gm:
        assert convergence[arm]["bytes_per_learner"]["median"] > 0
        assert convergence[arm]["rounds_committed"]["median"] > 0
    store = load("store")
    for backend in ("asyncio", "trio"):
        for kind in ("local", "s3"):
            assert store[backend][kind]["list"]["ratio"] > 0
    rounds = load("rounds")
    assert rounds["scale"]["fit"]["slope"] > 0
    assert all(entry["rounds"] > 0 for entry in rounds["scale"]["by_n"].values())
    overhead = load("overhead")
    assert overhead["steps_per_s_node"]["median"] > 0
    transfer = load("transfer")
    for backend in ("asyncio", "trio"):
        for kind in ("local", "s3"):
            for op in ("put", "get"):
                assert transfer[backend][kind][op]["ratio_vs_raw"] > 0
    memory = load("memory")
    for role in ("publish", "close"):
        assert memory["memory"][role]["fit_above_start"]["slope"] > 0
    assert len(memory["latency"]["values_s"]) >= 2
    assert all(value > 0 for value in memory["latency"]["values_s"])
    assert overhead["rounds_committed"] > 0
    assert all(idle["learner_core_percent"] > 0 for idle in overhead["idle"].values())


def test_the_page_and_plots_are_generated(quick_run: tuple[Path, Path, str]) -> None:
    _, docs, _ = quick_run
    page = (docs / "benchmarks.md").read_text(encoding="utf-8")
    for heading in (
        "## Targets",
        "## 1. Convergence and bytes",
        "## 2. Step overhead",
        "## 3. Store throughput",
        "## 4. Round latency and scale",
    ):
        assert heading in page
    assert "quick variant" in page
    assert "Not measured" not in page.split("## 5.")[0]
    for plot in ("convergence.png", "bytes.png", "store.png", "scale.png"):
        data = (docs / "benchmarks" / plot).read_bytes()
        assert data.startswith(b"\x89PNG"), plot
