"""What a kill cost a real-text arm: its survivors' pauses and its restarted learner's return.

From the learners' reports (each step's ``time.monotonic()``) and the times of the kill and
the restart (``_launch.launch``'s events), for the ``*-kill`` arms.
"""

import itertools
from typing import Any

import bench_text_task as task


def kill_times(run: dict[str, Any]) -> dict[str, float]:
    """When a kill arm's learner was killed and restarted (``time.monotonic()``): stored
    by the run, or for a run from before they were, worked out from its restarted learner's
    first step and the seconds the run reported from its restart to it and from the kill
    to the restart."""
    if "kill_times" in run:
        return dict(run["kill_times"])
    failure = run["failure"]
    back = next(r for r in run["learners"] if r["index"] == task.KILLED)
    restarted = back["step_times"][0] - failure["restarted_first_step_seconds"]
    return {"killed": restarted - failure["restart_after_seconds"], "restarted": restarted}


def failure(
    events: dict[str, float], learners: list[dict[str, Any]], eval_every: int
) -> dict[str, Any]:
    """What the kill cost: for each survivor, the longest pause between two steps after the
    kill and its time beyond its median step for the steps after the kill (both against its
    own median step time before the kill, leaving out the gaps that hold an evaluation:
    every ``eval_every`` steps, in every arm alike, up to seconds at the full size); for the
    restarted learner, seconds from its restart to its first step and to its first step on
    the group's model."""
    killed, restarted = events["killed"], events["restarted"]
    survivors = {}
    for report in learners:
        if report["index"] == task.KILLED:
            continue
        times = report["step_times"]
        # The gap after step n (1-based) holds the evaluation when n is a multiple of
        # eval_every.
        spans = [
            (a, b - a)
            for n, (a, b) in enumerate(itertools.pairwise(times), start=report["first_step"] + 1)
            if n % eval_every
        ]
        gaps = [g for _, g in spans]
        before = [g for a, g in spans if a < killed] or gaps
        after = [g for a, g in spans if a >= killed]
        median = sorted(before)[len(before) // 2] if before else 0.0
        survivors[str(report["index"])] = {
            "median_step_seconds": median,
            "longest_pause_after_kill": max(after, default=0.0),
            "seconds_beyond_median_after_kill": sum(max(0.0, g - median) for g in after),
            "steps_after_kill": len(after),
            "failed_syncs": report.get("failed_syncs"),
        }
    back = next(r for r in learners if r["index"] == task.KILLED)
    first_step = back["step_times"][0] - restarted if back["step_times"] else None
    # A gradientmail learner loads the committed model before its first step.
    on_group = back.get("group_model_at", restarted + (first_step or 0.0))
    return {
        "killed_at_step": back["first_step"],
        "restart_after_seconds": restarted - killed,
        "survivors": survivors,
        "survivors_longest_pause": max(s["longest_pause_after_kill"] for s in survivors.values()),
        "survivors_seconds_beyond_median": max(
            s["seconds_beyond_median_after_kill"] for s in survivors.values()
        ),
        "restarted_first_step_seconds": first_step,
        "restarted_on_group_model_seconds": None if on_group is None else on_group - restarted,
    }
