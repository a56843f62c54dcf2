"""The page's section 7, the defaults grid on the synthetic language
(``bench_convergence.py --grid``'s results): the best value of each setting, every point,
and where ``RunConfig``'s defaults stand."""

from typing import Any

from _page import Page, num, provenance, table

GRID_KEY = ("outer_lr", "outer_momentum", "sync_every", "quorum_fraction", "grace", "pattern")


def _grid_defaults() -> dict[str, Any]:
    """``RunConfig``'s defaults for the grid's settings, as the code stands."""
    from gradientmail.protocol.records import RunConfig

    defaults = RunConfig()
    return {key: getattr(defaults, key) for key in GRID_KEY}


def defaults_grid(page: Page, result: dict[str, Any] | None) -> None:
    """The outer-optimizer × H × quorum × pattern grid of ``bench_convergence.py --grid``:
    the best value of each setting, every point, and where ``RunConfig``'s defaults stand."""
    page.add("## 7. The defaults grid (synthetic language)", "")
    if result is None:
        page.add(
            "_Not measured: `benchmarks/results/convergence-grid.json` is missing "
            "(`.venv/bin/python benchmarks/bench_convergence.py --grid`)._",
            "",
        )
        return
    p, figures = result["parameters"], result["figures"]
    references, points = figures["references"], figures["points"]
    defaults = _grid_defaults()
    page.add(
        provenance(result),
        "",
        f"One gradientmail run per point (section 1's task and learners, {p['steps']} steps, "
        f"seed {p['seed']}, {p['encoding']}), best first by excess over the entropy floor ÷ "
        f"data-parallel's ({num(references['dp']['excess'], 4)}); a single learner's excess "
        f"is {num(references['single']['excess'], 4)}. One seed: a difference of a few "
        "percent between neighbours is within noise. Quorum / grace: a round closes once it "
        "has that fraction of the live learners, then waits up to grace for the rest.",
        "",
        "The best point for each value of each setting (the other settings free):",
        "",
        *_best_table(points, defaults),
    )
    chosen = next(
        (point for point in points if all(point[k] == defaults[k] for k in GRID_KEY)), None
    )
    best = points[0]
    if chosen is not None:
        page.target(
            "defaults grid: RunConfig's defaults against the grid's best point",
            "within 10% of the best",
            f"{num(chosen['excess_ratio_vs_dp'], 3)} vs {num(best['excess_ratio_vs_dp'], 3)} "
            "(excess ÷ DP's)",
            chosen["excess_ratio_vs_dp"] <= 1.1 * best["excess_ratio_vs_dp"],
            "bench_convergence --grid (one seed)",
        )
    page.add("<details><summary>Every point</summary>", "", *_points_table(points, chosen))
    page.add("</details>", "")


def _best_table(points: list[dict[str, Any]], defaults: dict[str, Any]) -> list[str]:
    rows = []
    for key in GRID_KEY:
        for value in sorted({point[key] for point in points}):
            best = min(
                (point for point in points if point[key] == value),
                key=lambda point: point["excess_ratio_vs_dp"],
            )
            marker = " (default)" if defaults[key] == value else ""
            rows.append([key, f"{value}{marker}", num(best["excess_ratio_vs_dp"], 3)])
    return table(["setting", "value", "best excess ÷ DP's"], rows)


def _points_table(points: list[dict[str, Any]], chosen: dict[str, Any] | None) -> list[str]:
    rows = [
        [
            num(point["outer_lr"], 2),
            num(point["outer_momentum"], 2),
            str(point["sync_every"]),
            f"{num(point['quorum_fraction'], 2)} / {num(point['grace'], 1)} s",
            point.get("pattern", "contiguous"),
            num(point["excess"], 4),
            num(point["excess_ratio_vs_dp"], 3),
            num(point["mean_participants"], 2),
            "**default**" if point is chosen else "",
        ]
        for point in points
    ]
    header = ["outer lr", "outer momentum", "H", "quorum / grace", "pattern", "excess"]
    return table([*header, "excess ÷ DP's", "snapshots per round", ""], rows)
