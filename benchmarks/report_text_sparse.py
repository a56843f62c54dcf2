"""The full real-text size's targets for the ``topk`` encoding: bytes per learner against
data-parallel's at H 50 (at a loss no worse than int8's) and H 100, with the syncer's share at
H 50, and the run's peak storage (``bench_text.py``'s ``gm-topk*`` arms)."""

from typing import Any

from _page import Page, num

BYTES_AT = {50: 2000.0, 100: 3000.0}
"""Data-parallel's bytes ÷ a learner's that the ``topk`` arms aim at, by H."""
WITH_SYNCER_AT_50 = 1000.0
"""The same with the syncer's bytes shared among the learners, at H 50."""
PEAK_STORAGE = 3.0
"""The run's largest storage over the model's fp32 size."""
NOTE = "bench_text --only gm-topk*; see section 6"


def targets(page: Page, result: dict[str, Any]) -> None:
    """The ``topk`` targets, from the arms measured (nothing when none is)."""
    p, arms = result["parameters"], result["figures"]["arms"]
    dp = arms.get("dp", {}).get("bytes_per_learner")
    sparse = {arm: run for arm, run in arms.items() if arm.startswith("gm-topk")}
    if not dp or not sparse:
        return
    int8 = arms.get("gm-int8-H50", {}).get("bits_per_byte")
    at_50 = {arm: run for arm, run in sparse.items() if arm.endswith("-H50")}
    if int8 is not None and at_50:
        fit = [(dp / run["bytes_per_learner"], arm) for arm, run in at_50.items()]
        good = [ratio for ratio, arm in fit if at_50[arm]["bits_per_byte"] <= int8]
        page.target(
            "real text (full) topk H=50: DP bytes ÷ a learner's, bits/byte ≤ int8's",
            f"≥ {BYTES_AT[50]:,.0f}×",
            ", ".join(
                f"{a.removeprefix('gm-').removesuffix('-H50')} {r:,.0f}× at "
                f"{num(at_50[a]['bits_per_byte'], 4)}"
                for r, a in sorted(fit)
            )
            + f" (int8 {num(int8, 4)})",
            max(good, default=0.0) >= BYTES_AT[50],
            NOTE,
        )
    at_100 = [dp / run["bytes_per_learner"] for arm, run in sparse.items() if arm.endswith("-H100")]
    if at_100:
        page.target(
            "real text (full) topk H=100: DP bytes ÷ a learner's",
            f"≥ {BYTES_AT[100]:,.0f}×",
            f"{max(at_100):,.0f}×",
            max(at_100) >= BYTES_AT[100],
            NOTE,
        )
    shared = [
        dp / (run["bytes_per_learner"] + run["syncer_bytes"] / p["learners"])
        for run in at_50.values()
    ]
    if shared:
        page.target(
            "real text (full) topk H=50: DP bytes ÷ a learner's with the syncer's share",
            f"≥ {WITH_SYNCER_AT_50:,.0f}×",
            f"{max(shared):,.0f}×",
            max(shared) >= WITH_SYNCER_AT_50,
            NOTE,
        )
    peaks = [run["peak_store_bytes"] / (4 * p["params"]) for run in sparse.values()]
    page.target(
        "real text (full) topk: peak storage ÷ the model's fp32 size, every arm",
        f"≤ {PEAK_STORAGE:g}",
        num(max(peaks), 2),
        max(peaks) <= PEAK_STORAGE,
        NOTE,
    )
