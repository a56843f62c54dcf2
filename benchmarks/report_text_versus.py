"""gradientmail against torchft on real text (``bench_text.py``'s results): the ratios at
each H, the pairs run in both orders, and a learner killed in each system."""

from typing import Any

import bench_text
import report_fair
from _page import Page, num, provenance, table
from report_text_runs import pacing, placement, text_order


def timing_pairs(result: dict[str, Any]) -> dict[str, Any]:
    """The pairs run in both orders (``text-timing-{size}.json``) whose gradientmail runs
    were paced as the matrix's gradientmail arm of the same H (a timing file without
    ``overlap`` is older than the paced default: unpaced)."""
    timing = result.get("timing")
    if timing is None:
        return {}
    header = {"overlap": result["parameters"].get("overlap")}
    arms = result["figures"]["arms"]
    return {
        sync_every: pair
        for sync_every, pair in timing["figures"]["pairs"].items()
        if arms.get(f"gm-fp32-H{sync_every}", {}).get("measured", header)["overlap"]
        == timing_overlap(timing, pair)
    }


def timing_overlap(timing: dict[str, Any], pair: dict[str, Any]) -> int | None:
    """The ``RunConfig.overlap`` of a pair's gradientmail runs: its invocation's (a pair
    without ``measured`` is the file header's; a header without ``overlap`` is older than
    the paced default: unpaced)."""
    return pair.get("measured", {"overlap": timing["parameters"].get("overlap")})["overlap"]


def versus(page: Page, result: dict[str, Any]) -> None:
    """gradientmail ÷ torchft at each H; the wall target is judged on the pairs run in both
    orders (``timing_pairs``) where they were measured, else on the matrix's pair (and
    not at all for a pair whose arms two invocations measured)."""
    by_h = result["figures"]["versus_torchft"]
    if not by_h:
        return
    pairs = timing_pairs(result)
    page.add(
        "gradientmail ÷ torchft, fp32, the same H, each pair measured in one invocation (–: not):",
        "",
    )
    rows = []
    for sync_every, v in sorted(by_h.items(), key=lambda item: int(item[0])):
        gm_excess, ft_excess = v["excess_over_dp"]
        rows.append(
            [
                sync_every,
                num(v["bits_per_byte_ratio"], 4),
                f"{num(gm_excess, 4)} vs {num(ft_excess, 4)}",
                num(v["wall_ratio"], 2),
                num(v["train_ratio"], 2),
                num(v.get("cpu_ratio"), 2),
                num(v["bytes_ratio"], 2),
            ]
        )
        _versus_targets(page, result, sync_every, v, pairs.get(sync_every, {}).get("wall_ratio"))
    header = ["H", "bits/byte ratio", "excess over DP (gm vs torchft)", "wall ratio"]
    page.add(*table([*header, "train ratio", "CPU ratio", "bytes ratio"], rows))


def _versus_targets(
    page: Page, result: dict[str, Any], sync_every: str, v: dict[str, Any], both: float | None
) -> None:
    """The excess and wall targets of one H; ``both``: the wall ratio of the pairs run in
    both orders, None where not measured."""
    size = result["parameters"]["size"]
    gm_excess, ft_excess = v["excess_over_dp"]
    judged = report_fair.fair(result)
    met = None if gm_excess is None or ft_excess is None else gm_excess <= ft_excess
    page.target(
        f"real text ({size}) H={sync_every}: excess over DP, gradientmail vs torchft",
        "≤ torchft's",
        f"{num(gm_excess, 4)} vs {num(ft_excess, 4)} bits/byte",
        met if judged else report_fair.NOT_JUDGED,
        "bench_text",
    )
    wall = v["wall_ratio"] if both is None else both
    own = (
        num(v["wall_ratio"], 2)
        if v["wall_ratio"] is not None
        else "not measured: its arms come from two invocations"
    )
    page.target(
        f"real text ({size}) H={sync_every}: wall time ÷ torchft's",
        "≤ 1.0",
        own
        if both is None
        else f"{num(both, 3)} (each pair in both orders; the matrix's own pair {own})",
        (None if wall is None else wall <= 1.0) if judged else report_fair.NOT_JUDGED,
        "bench_text" if both is None else "bench_text --mode timing",
    )


def timing(page: Page, measured_timing: dict[str, Any]) -> None:
    """The fp32 pairs run in both orders (``bench_text_timing``)."""
    p = measured_timing["parameters"]
    rows = []
    pairs = measured_timing["figures"]["pairs"]
    for sync_every, pair in sorted(pairs.items(), key=lambda i: int(i[0])):
        walls = {
            system: ", ".join(num(run["wall_seconds"], 0) for run in pair[system])
            for system in ("gm", "torchft")
        }
        measured = pair.get("measured", bench_text.invocation(measured_timing))
        bits = {
            system: ", ".join(num(run["bits_per_byte"], 6) for run in pair[system])
            for system in ("gm", "torchft")
        }
        rows.append(
            [
                sync_every,
                pacing(timing_overlap(measured_timing, pair)),
                measured["date"][:10],
                ("fair" if measured.get("harness") == bench_text.HARNESS else "earlier")
                + ("" if measured.get("syncer_in") is None else f"; {placement(measured)}"),
                walls["gm"],
                walls["torchft"],
                bits["gm"],
                bits["torchft"],
                num(pair.get("wall_ratio"), 3),
                num(pair.get("wall_ratio_gm_first"), 3),
                num(pair.get("wall_ratio_torchft_first"), 3),
                num(pair.get("train_ratio"), 3),
                num(pair.get("cpu_ratio"), 3),
            ]
        )
    header = ["H", "gradientmail", "measured", "harness", "gradientmail wall (s)"]
    header += ["torchft wall (s)", "gradientmail bits/byte", "torchft bits/byte"]
    header += ["wall ratio", "gm first", "torchft first", "train ratio", "CPU ratio"]
    page.add(
        "Wall time with each fp32 pair run in both orders ("
        + ", ".join(p["order"])
        + "), so that this machine's drift weighs on both systems alike; the ratio is both "
        "gradientmail runs' time over both torchft runs'. Harness: `fair` for torchft "
        "with `init_sync` off and both judged on the mean of the learners' models, `earlier` "
        "for a pair that did not record it; where the gradientmail runs' syncer ran when not "
        "a process of its own. "
        + provenance(measured_timing)
        + f" Produced by `benchmarks/bench_text.py --size {p['size']} --mode timing`.",
        "",
        *table(header, rows),
    )


def _lost(run: dict[str, Any]) -> tuple[int, str]:
    """Survivors' discarded work in a kill arm, from each learner's own report: gradientmail's
    rejected snapshots (a survivor's steps count unless its snapshot is rejected), torchft's
    failed syncs (the fragment goes back to its last committed value); the restarted
    learner's are given apart."""
    gm = "rounds_committed" in run

    def lost(learner: dict[str, Any]) -> int:
        return int(learner["events"].get("snapshot_rejected", 0) if gm else learner["failed_syncs"])

    survivors = sum(lost(r) for r in run["learners"] if r["first_step"] == 0)
    restarted = sum(lost(r) for r in run["learners"] if r["first_step"] > 0)
    what = "snapshots rejected" if gm else "failed syncs"
    return survivors, f"{survivors} {what} (restarted learner: {restarted})"


def failure(page: Page, killed: dict[str, Any], arms: dict[str, Any], p: dict[str, Any]) -> None:
    """A learner killed and restarted in each system, side by side."""
    if not killed:
        return
    kill = p["kill"]
    page.add(
        f"Failure side by side: learner {kill['learner']} SIGKILLed at "
        f"{kill['at_fraction']:.0%} of its steps and started again "
        f"{kill['restart_after']:.0f} s later; it resumes at the step it reached, on a new "
        "stream of its shard. A survivor's pause and time beyond its median step are "
        "measured against its own median step before the kill, leaving out the gaps that "
        f"hold an evaluation (every {p['eval_every']} steps, in both systems alike); "
        '"on the group\'s model" is '
        "when the restarted learner first holds the committed model (gradientmail: loaded "
        "before its first step; torchft: its first committed sync, which heals it).",
        "",
    )
    rows = []
    for arm in sorted(killed, key=text_order):
        f = killed[arm]
        lost, lost_text = _lost(arms[arm])
        rows.append(
            [
                arm,
                str(f["killed_at_step"]),
                num(f["survivors_longest_pause"], 2),
                num(f["survivors_seconds_beyond_median"], 2),
                lost_text,
                num(f["restarted_first_step_seconds"], 1),
                num(f["restarted_on_group_model_seconds"], 1),
                num(f["bits_per_byte"], 4),
            ]
        )
        page.target(
            f"real text ({p['size']}), {arm.split('-')[0]}: survivors' work discarded after a kill",
            "none",
            f"{lost_text}; longest pause {num(f['survivors_longest_pause'], 2)} s",
            lost == 0,
            "bench_text",
        )
    header = ["arm", "killed at step", "survivors' longest pause (s)"]
    header += ["survivors' time beyond median (s)", "survivors' lost work"]
    header += ["restart → first step (s)", "restart → on the group's model (s)"]
    page.add(*table([*header, "final bits/byte"], rows))
