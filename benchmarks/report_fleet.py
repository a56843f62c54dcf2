"""The page's section on fleets of unequal machines (``bench_fleet.py``'s results)."""

import statistics
from typing import Any

import bench_fleet
import bench_fleet_task
from _page import Page, num, provenance, table

HETEROGENEOUS = ("mixed", "straggler", "pausing")
EQUAL = ("equal", "equal-H100", "equal-H250")
_EQUAL_AGAINST = (
    ("gm-repeatable", "the repeatable mode", "within 0.5%", 1.005),
    ("torchft", "torchft DiLoCo", "no worse", 1.0),
)
"""What an equal fleet's default is held to at each H: the arm, its name, the target and the
factor of the arm's bits per byte the default may reach."""
ARM_LABEL = {
    "gm": "gradientmail, default (adaptive)",
    "gm-repeatable": "gradientmail, repeatable mode",
    "gm-sync": "gradientmail, synchronous mode",
    "torchft": "torchft DiLoCo",
    "dp": "data-parallel, fastest speed",
}


def _against(runs: dict[str, list[dict[str, Any]]], key: str) -> float | str | None:
    """The median bits per byte the default is judged against (``key``: fleet/arm); a
    reason instead where only torchft runs judged on the mean of their replicas' losses
    were stored (not the model the default is judged on)."""
    entries = runs.get(key, [])
    if key.endswith("/torchft"):
        judged = [r for r in entries if r.get("evaluation") == bench_fleet.EVALUATION]
        if entries and not judged:
            return "not judged: torchft on the mean of its replicas' losses"
        entries = judged
    return _median(entries, "bits_per_byte")


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _range(runs: list[dict[str, Any]], key: str, digits: int = 3) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return num(values[0], digits)
    low, high = num(min(values), digits), num(max(values), digits)
    return f"{num(statistics.median(values), digits)} [{low}, {high}]"


def _ratios(fleet: str, run: dict[str, Any], p: dict[str, Any]) -> dict[str, float]:
    """A run's steps: committed ÷ taken (1: no step lost), and taken and committed ÷ what
    each learner takes alone in the budget at its nominal speed, its pauses included
    (``bench_fleet_task.alone_steps``; below 1: it waited, or the machine was too busy for its
    nominal speed)."""
    learners = run.get("learners", [])
    last = len(learners) - 1
    taken = sum(x["steps"] for x in learners)
    alone = sum(
        bench_fleet_task.alone_steps(
            x["speed"],
            p["budget"],
            pauses=fleet == "pausing" and k == last,
            base_step=p["base_step"],
            pause=(p["pause"][0], p["pause"][1]),
        )
        for k, x in enumerate(learners)
    )
    committed = sum(x.get("committed_steps", 0.0) for x in learners)
    return {
        "committed_over_taken": committed / taken if taken else 0.0,
        "taken_over_alone": taken / alone if alone else 0.0,
        "committed_over_alone": committed / alone if alone else 0.0,
    }


def _count(runs: list[dict[str, Any]]) -> str:
    """How many runs, and of which seeds where any is not seed 0 (runs stored without one
    were of seed 0)."""
    seeds = sorted({r.get("seed", 0) for r in runs})
    if seeds == [0]:
        return str(len(runs))
    return f"{len(runs)} (seeds {', '.join(str(s) for s in seeds)})"


def _row(fleet: str, arm: str, runs: list[dict[str, Any]], p: dict[str, Any]) -> list[str]:
    speeds = "/".join(f"{s:g}" for s in bench_fleet_task.FLEETS.get(fleet, []))
    learners = [r["learners"] for r in runs if "learners" in r]
    ratios = [r | _ratios(fleet, r, p) for r in runs]
    committed = [sum(x.get("committed_steps", 0.0) for x in ls) for ls in learners]
    steps = "–"
    if learners:
        steps = ", ".join(f"{x['steps']}" for x in learners[0])
    return [
        f"{fleet} ({speeds})",
        ARM_LABEL.get(arm, arm),
        _count(runs),
        _range(runs, "bits_per_byte"),
        _range(runs, "bits_per_byte_before_close"),
        _range(runs, "bits_per_byte_committed"),
        _range(runs, "fastest_waiting_share", 2),
        _range(ratios, "committed_over_taken", 3) if any(committed) else "–",
        _range(ratios, "taken_over_alone", 2) if learners else "–",
        steps,
        _range(runs, "rounds", 0),
        _range([{"load": r["load"][0]} for r in runs if "load" in r], "load", 1),
    ]


def fleets(page: Page, result: dict[str, Any] | None) -> None:
    """Section 14: every fleet × arm, the targets of the adaptive default, and the curves."""
    page.add("## 14. Fleets of unequal machines", "")
    if result is None:
        page.add("_Not run: `benchmarks/bench_fleet.py` writes `fleet.json`._", "")
        return
    p, runs = result["parameters"], result["figures"]["runs"]
    page.add(
        f"The real-text task at size `{p['size']}` (K = 4, H {p['sync_every']} but where the "
        "fleet's name gives another, as `equal-H100`), every arm "
        f"{p['budget']:.0f} s of wall time per learner; a learner of speed s takes s × "
        f"{p['base_step']} s a step (its compute, then a sleep); `pausing`'s learner 3 stops "
        f"{p['pause'][0]:.0f} s every {p['pause'][1]} steps; `*-matched` fleets are equal "
        "fleets that take as many steps in the budget; `equal-steps` is the equal fleet with "
        "the learning rate set by each learner's steps instead of the clock (the rates do not "
        "depend on the timing). Bits per byte: the shared model after "
        "the close (gradientmail: the newest committed model once every learner closed; "
        "torchft: the mean of its replicas' models after their last sync, as the fair "
        "real-text harness judges it); before close: the learners' own models when the "
        "budget ended (the mean of their losses; gradientmail's close ends on the mean of "
        "those models); committed θ: the newest committed model then, "
        "before any final round (the model the close starts from). Waiting: the fastest "
        "learner's share of its time waiting on rounds (torchft: its steps' time beyond "
        "their own, blocked in a sync). "
        "Committed ÷ taken: the steps that reached a committed round over the steps the "
        "learners took (1: none lost); taken ÷ alone: over what each takes alone in the "
        "budget at its nominal speed (below 1: waiting, or a machine too busy for its "
        "nominal speed: see the load). Several runs: median [min, max]; runs of seed 0 "
        "(the timing differs from run to run) but where the runs column names seeds.",
        "",
        provenance(result),
        "",
        *_invocations(result),
    )
    rows = [_row(*key.split("/"), entries, p) for key, entries in sorted(runs.items())]
    header = ["fleet", "arm", "runs", "bits/byte", "before close", "committed θ"]
    header += ["fastest waits"]
    header += [
        "committed ÷ taken",
        "taken ÷ alone",
        "steps per learner (first run)",
        "rounds",
        "load",
    ]
    page.add(*table(header, rows))
    _targets(page, runs, p)
    _plot(page, runs)


def _invocations(result: dict[str, Any]) -> list[str]:
    """A line per invocation whose runs the file holds (``--keep`` measures in parts)."""
    by: dict[tuple[str, str], set[str]] = {}
    for key, entries in result["figures"]["runs"].items():
        for r in entries:
            mark = r.get("measured", {"date": result["date"], "git_commit": result["git_commit"]})
            by.setdefault((mark["date"], mark["git_commit"]), set()).add(key)
    if len(by) < 2:
        return []
    lines = [f"- {date}: {', '.join(sorted(keys))}" for (date, _), keys in sorted(by.items())]
    return ["Measured in parts:", "", *lines, ""]


def _targets(page: Page, runs: dict[str, list[dict[str, Any]]], p: dict[str, Any]) -> None:
    for fleet in HETEROGENEOUS:
        gm = runs.get(f"{fleet}/gm", [])
        if not gm:
            continue
        waits = max(r["fastest_waiting_share"] for r in gm)
        page.target(
            f"fleet {fleet}: the fastest learner's waiting, default",
            "≤ 5% in every run",
            f"{waits:.1%} at most, {len(gm)} run(s)",
            waits <= 0.05,
            "bench_fleet",
        )
        ratios = [_ratios(fleet, r, p) for r in gm]
        committed = min(r["committed_over_alone"] for r in ratios)
        kept = min(r["committed_over_taken"] for r in ratios)
        page.target(
            f"fleet {fleet}: steps committed ÷ each alone, default",
            "≥ 0.9 in every run",
            f"{committed:.3f} at least, {len(gm)} run(s); committed ÷ taken {kept:.3f} at least",
            committed >= 0.9,
            "bench_fleet",
        )
        worst = max(r["bits_per_byte"] for r in gm)
        for other in ("gm-repeatable", "torchft"):
            theirs = _against(runs, f"{fleet}/{other}")
            judged = theirs if isinstance(theirs, float) else None
            reason = theirs if isinstance(theirs, str) else None
            page.target(
                f"fleet {fleet}: default's bits per byte vs {ARM_LABEL[other]}",
                "lower in every run",
                f"{num(worst)} at worst against {num(judged)}",
                reason if judged is None else worst < judged,
                "bench_fleet",
            )
        matched = _median(runs.get(f"{fleet}-matched/gm", []), "bits_per_byte")
        if matched is not None:
            page.target(
                f"fleet {fleet}: default vs an equal fleet taking as many steps",
                "within 1%",
                f"{num(worst)} at worst against {num(matched)} ({worst / matched - 1:+.1%})",
                worst <= 1.01 * matched,
                "bench_fleet",
            )
    _equal_targets(page, runs)
    _close_targets(page, runs)


def _close_targets(page: Page, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Per fleet, the default's close against the newest committed θ before it: stale final
    snapshots must not make the shared model worse."""
    for fleet in ("equal", *HETEROGENEOUS):
        gm = [r for r in runs.get(f"{fleet}/gm", []) if r.get("bits_per_byte_committed")]
        if not gm:
            continue
        margins = [r["bits_per_byte_committed"] - r["bits_per_byte"] for r in gm]
        page.target(
            f"fleet {fleet}: the close vs the committed θ it started from, default",
            "lower in every run",
            f"{num(min(margins))} bits per byte lower at least, {len(gm)} run(s)",
            min(margins) > 0,
            "bench_fleet",
        )


def _equal_targets(page: Page, runs: dict[str, list[dict[str, Any]]]) -> None:
    """At each H measured, the equal fleet's default against the repeatable mode and
    against torchft."""
    for fleet in EQUAL:
        equal = _median(runs.get(f"{fleet}/gm", []), "bits_per_byte")
        if equal is None:
            continue
        at = f"H {bench_fleet_task.sync_every(fleet)}"
        for other, name, target, factor in _EQUAL_AGAINST:
            theirs = _against(runs, f"{fleet}/{other}")
            if theirs is None:
                continue
            page.target(
                f"equal fleet, {at}: default vs {name}",
                target,
                _versus(equal, theirs),
                theirs if isinstance(theirs, str) else equal <= factor * theirs,
                "bench_fleet",
            )


def _versus(ours: float, theirs: float | str) -> str:
    """``ours`` against the figure judged against, with the difference (``ours`` alone
    where there is none, ``theirs`` then being the reason)."""
    if isinstance(theirs, str):
        return num(ours)
    return f"{num(ours)} against {num(theirs)} ({ours / theirs - 1:+.2%})"


def _plot(page: Page, runs: dict[str, list[dict[str, Any]]]) -> None:
    shown = [f for f in ("equal", *HETEROGENEOUS) if any(k.startswith(f"{f}/") for k in runs)]
    if not any(r.get("curve") for entries in runs.values() for r in entries):
        page.add("_No curves against wall time in this results file._", "")
        return

    def draw(figure: Any) -> None:
        for i, fleet in enumerate(shown):
            axes = figure.add_subplot(2, 2, i + 1)
            for arm, style in (("gm", "-"), ("gm-repeatable", "--"), ("torchft", ":")):
                # The first run that recorded its curve.
                curve = next(
                    (e["curve"] for e in runs.get(f"{fleet}/{arm}", []) if e.get("curve")), None
                )
                if curve:
                    axes.plot(*zip(*curve, strict=True), style, label=ARM_LABEL[arm])
            dp = runs.get("equal/dp", [])
            if dp and dp[0].get("curve"):
                axes.plot(*zip(*dp[0]["curve"], strict=True), "k-", lw=0.8, label=ARM_LABEL["dp"])
            axes.set_title(fleet, fontsize=9)
            axes.set_xlabel("seconds", fontsize=8)
            axes.set_ylabel("bits per byte", fontsize=8)
            axes.set_ylim(2.3, 4.5)
            axes.grid(True, alpha=0.3)
            if axes.get_legend_handles_labels()[0]:
                axes.legend(fontsize=6)

    page.plot("fleet.png", draw, "validation bits per byte against wall time, per fleet and arm")
