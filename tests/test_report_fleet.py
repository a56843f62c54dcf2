"""docs/benchmarks.md's fleet section (``benchmarks/report_fleet.py``) from a results file
of known figures: the table's rows, the steps' ratios and the targets' verdicts."""

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _page  # noqa: E402
import report_fleet  # noqa: E402


def learners(*steps: tuple[float, int, float]) -> list[dict[str, Any]]:
    return [
        {"speed": s, "steps": n, "committed_steps": c, "waiting_share": 0.0} for s, n, c in steps
    ]


def run(bits: float, waits: float, *steps: tuple[float, int, float]) -> dict[str, Any]:
    return {
        "bits_per_byte": bits,
        "fastest_waiting_share": waits,
        "learners": learners(*steps),
        "rounds": 10,
        "load": [0.5, 0.5, 0.5],
    }


def torchft(bits: float, waits: float) -> dict[str, Any]:
    """A torchft run judged on the mean of its replicas' models."""
    evaluation = report_fleet.bench_fleet.EVALUATION
    return {"bits_per_byte": bits, "fastest_waiting_share": waits, "evaluation": evaluation}


def result() -> dict[str, Any]:
    fast = [(1.0, 100, 100.0), (1.0, 100, 100.0), (1.0, 100, 100.0), (4.0, 25, 25.0)]
    slow = [(1.0, 25, 25.0), (1.0, 25, 25.0), (1.0, 25, 25.0), (4.0, 25, 25.0)]
    return {
        "benchmark": "fleet",
        "date": "2026-01-01T00:00:00+00:00",
        "quick": False,
        "git_commit": "0" * 40,
        "machine": {"cpus": 2, "processor": "x86_64", "load_average_1m": 0.5},
        "load_average_1m_after": 0.5,
        "versions": {"python": "3.11"},
        "parameters": {
            "size": "medium",
            "base_step": 1.0,
            "sync_every": 50,
            "budget": 100.0,
            "pause": [15.0, 250],
        },
        "figures": {
            "runs": {
                "straggler/gm": [run(2.8, 0.0, *fast), run(2.9, 0.01, *fast)],
                "straggler/gm-repeatable": [run(3.7, 0.75, *slow)],
                "straggler/torchft": [torchft(2.7, 0.7)],
            }
        },
    }


def test_the_section_tabulates_every_arm_and_judges_the_default(tmp_path: Path) -> None:
    page = _page.Page(tmp_path)
    report_fleet.fleets(page, result())
    text = "\n".join(page.lines)
    # Two runs: median [min, max]; every step committed; a quarter of alone in the repeatable.
    assert (
        "| straggler (1/1/1/4) | gradientmail, default (adaptive) | 2 | 2.850 [2.800, 2.900]"
        in text
    )
    assert "| 1.000 [1.000, 1.000] | 1.00 [1.00, 1.00] |" in text
    assert "| 0.75 | 1.000 | 0.31 |" in text
    verdicts = {row[0]: row[3] for row in page.targets}
    assert verdicts["fleet straggler: the fastest learner's waiting, default"] == "met"
    assert verdicts["fleet straggler: steps committed ÷ each alone, default"] == "met"
    assert (
        verdicts["fleet straggler: default's bits per byte vs gradientmail, repeatable mode"]
        == "met"
    )
    # torchft ended lower than the default's worst run: the target is missed, and says so.
    assert verdicts["fleet straggler: default's bits per byte vs torchft DiLoCo"] == "**missed**"


def test_a_missing_results_file_says_so(tmp_path: Path) -> None:
    page = _page.Page(tmp_path)
    report_fleet.fleets(page, None)
    assert any("Not run" in line for line in page.lines)


def test_the_section_names_the_dates_of_its_runs_not_their_commits(tmp_path: Path) -> None:
    measured = result() | {"git_commit": "decade" * 6 + "beef"}
    later = {"date": "2026-01-02T00:00:00+00:00", "git_commit": "c0ffee" * 6 + "beef"}
    measured["figures"]["runs"]["straggler/torchft"][0]["measured"] = later
    page = _page.Page(tmp_path)
    report_fleet.fleets(page, measured)
    text = "\n".join(page.lines)
    assert "_Source: `benchmarks/results/fleet.json`, 2026-01-01T00:00:00+00:00, 2 CPUs" in text
    assert "- 2026-01-01T00:00:00+00:00: straggler/gm, straggler/gm-repeatable" in text
    assert "- 2026-01-02T00:00:00+00:00: straggler/torchft" in text
    assert "decade" not in text
    assert "c0ffee" not in text


def test_the_equal_fleet_is_judged_at_each_h_against_the_repeatable_mode_and_torchft(
    tmp_path: Path,
) -> None:
    """The H of a fleet is in its name (``equal-H250``); at each H the default is held within
    0.5% of the repeatable mode and no worse than torchft, each verdict naming its H."""
    equal = [(1.0, 100, 100.0)] * 4
    measured = result()
    measured["figures"]["runs"] = {
        "equal/gm": [run(2.70, 0.0, *equal)],
        "equal/gm-repeatable": [run(2.71, 0.0, *equal)],
        "equal/torchft": [torchft(2.72, 0.01)],
        "equal-H250/gm": [run(3.00, 0.0, *equal)],
        "equal-H250/gm-repeatable": [run(2.90, 0.0, *equal)],
        "equal-H250/torchft": [torchft(2.95, 0.01)],
    }
    page = _page.Page(tmp_path)
    report_fleet.fleets(page, measured)
    verdicts = {row[0]: row[3] for row in page.targets}
    assert verdicts["equal fleet, H 50: default vs the repeatable mode"] == "met"
    assert verdicts["equal fleet, H 50: default vs torchft DiLoCo"] == "met"
    assert verdicts["equal fleet, H 250: default vs the repeatable mode"] == "**missed**"
    assert verdicts["equal fleet, H 250: default vs torchft DiLoCo"] == "**missed**"
    assert not any("H 100" in name for name in verdicts)


def test_torchft_runs_judged_on_the_mean_of_their_losses_are_not_judged(tmp_path: Path) -> None:
    """The default is judged against torchft only on the model it is itself judged on (the
    mean of the learners' models): torchft runs without that evaluation (the mean of their
    replicas' losses) say why they are not judged, whatever their figure."""
    equal = [(1.0, 100, 100.0)] * 4
    measured = result()
    losses = {"bits_per_byte": 3.5, "fastest_waiting_share": 0.7}
    measured["figures"]["runs"] |= {
        "straggler/torchft": [losses],
        "equal/gm": [run(2.70, 0.0, *equal)],
        "equal/torchft": [{"bits_per_byte": 2.60, "fastest_waiting_share": 0.0}],
    }
    page = _page.Page(tmp_path)
    report_fleet.fleets(page, measured)
    verdicts = {row[0]: row[3] for row in page.targets}
    reason = "not judged: torchft on the mean of its replicas' losses"
    assert verdicts["fleet straggler: default's bits per byte vs torchft DiLoCo"] == reason
    assert verdicts["equal fleet, H 50: default vs torchft DiLoCo"] == reason


def test_the_runs_column_names_the_seeds_where_runs_are_not_all_of_seed_0(
    tmp_path: Path,
) -> None:
    equal = [(1.0, 100, 100.0)] * 4
    measured = result()
    seeded = [run(2.70, 0.0, *equal) | {"seed": s} for s in (0, 1, 2)]
    measured["figures"]["runs"] |= {"equal/gm": seeded}
    page = _page.Page(tmp_path)
    report_fleet.fleets(page, measured)
    text = "\n".join(page.lines)
    assert "| equal (1/1/1/1) | gradientmail, default (adaptive) | 3 (seeds 0, 1, 2) |" in text
    assert "| straggler (1/1/1/4) | gradientmail, default (adaptive) | 2 |" in text


def test_each_unequal_fleet_has_an_equal_fleet_taking_as_many_steps_alone() -> None:
    """``X-matched`` takes what ``X``'s learners take alone in the budget, pauses included
    (within a step per learner: steps are whole)."""
    fleet_module = report_fleet.bench_fleet_task
    budget = fleet_module.BUDGET
    for fleet in ("mixed", "straggler", "pausing"):
        speeds = fleet_module.FLEETS[fleet]
        last = len(speeds) - 1
        unequal = sum(
            fleet_module.alone_steps(s, budget, pauses=fleet == "pausing" and k == last)
            for k, s in enumerate(speeds)
        )
        equal = sum(
            fleet_module.alone_steps(s, budget, pauses=False)
            for s in fleet_module.FLEETS[f"{fleet}-matched"]
        )
        assert abs(equal - unequal) <= len(speeds), (fleet, equal, unequal)
        assert len(set(fleet_module.FLEETS[f"{fleet}-matched"])) == 1


def test_the_steps_schedule_is_the_clock_schedule_over_the_steps_taken_alone() -> None:
    """``equal-steps`` sets the rate from the learner's steps over those it takes alone in
    the budget: the clock's curve (warm-up to the peak over the first 5%, then a decay to
    the floor, where it stays past the budget's steps); only fleets named so use it."""
    fleet_module = report_fleet.bench_fleet_task
    steps = fleet_module.alone_steps(1.0, fleet_module.BUDGET, pauses=False)
    scales = [fleet_module.step_scale(k, steps) for k in range(steps + 5)]
    assert scales[0] < scales[steps // 20] == max(scales) == 1.0
    assert scales[-1] == scales[steps] == min(scales[steps // 20 :]) > 0.0
    peak = scales.index(1.0)
    assert all(a >= b for a, b in zip(scales[peak:], scales[peak + 1 :], strict=False))
    assert [f for f in fleet_module.FLEETS if fleet_module.by_steps(f)] == ["equal-steps"]
    assert fleet_module.sync_every("equal-steps") == fleet_module.SYNC_EVERY
