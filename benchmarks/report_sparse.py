"""The page's section on sparse deltas, ``topk`` against int8
(``bench_convergence.py --sparse``'s results)."""

from typing import Any

from _page import Page, byte_size, num, provenance, table

ARMS = (
    "`topkN`: deltas at N% density, 2 bits, chunks of 4096, error feedback, plain averaging "
    "(no momentum; each element over the deltas that sent it) at outer lr 1, updates in "
    "`topk` (the union of the selections, 4 bits a value), the final "
    "snapshots and the final round's update `int4` (the run's closing round, counted "
    "in the bytes); `lrX`: the same at outer lr X; `nag`: the default Nesterov step "
    "(1.0 / 0.6) with int8 updates (its update is dense). Bytes per learner are measured, up "
    "and down; the delta and update columns are the mean blob sizes; peak storage is the "
    "largest size of the run's directory (sampled every 0.1 s) over the model's fp32 size."
)
"""What the section's arms and columns are."""


def convergence_sparse(page: Page, result: dict[str, Any] | None) -> None:
    """The ``topk`` arms against int8 (``bench_convergence.py --sparse``)."""
    page.add("## Sparse deltas: topk against int8", "")
    if result is None:
        page.add(
            "_Not measured: `benchmarks/results/convergence-sparse.json` is missing "
            "(`.venv/bin/python benchmarks/bench_convergence.py --quick --sparse`)._",
            "",
        )
        return
    p, figures = result["parameters"], result["figures"]
    page.add(
        provenance(result),
        "",
        f"Section 1's task and model ({p['params']:,} parameters, {p['steps']} steps, "
        f"{p['learners']} learners, seed {p['seeds'][0]}), H {p['sync_every'][0]}. " + ARMS,
        "",
    )
    rows = []
    for arm, entry in figures["arms"].items():
        run = figures["per_seed"][arm][str(p["seeds"][0])]
        gm = arm.startswith("gm-")
        rows.append(
            [
                arm,
                num(entry["final_loss"]["median"], 4),
                num(entry["excess_ratio_vs_dp"]["median"], 3) if arm != "dp" else "1",
                byte_size(run["bytes_up_per_learner"]) if gm else "–",
                byte_size(run["bytes_down_per_learner"]) if gm else "–",
                num(entry["bytes_ratio_dp_over_gm"]["median"], 0) if gm else "–",
                num(entry["bytes_ratio_with_syncer_share"]["median"], 0) if gm else "–",
                byte_size(run["mean_delta_bytes"]) if gm else "–",
                byte_size(run["mean_update_bytes"]) if gm else "–",
                num(run["peak_store_bytes"] / (4 * p["params"]), 2) if gm else "–",
            ]
        )
    page.add(
        *table(
            [
                "arm",
                "final eval loss",
                "excess ÷ DP's",
                "up per learner",
                "down per learner",
                "DP bytes ÷ gm bytes",
                "… with syncer share",
                "delta blob",
                "update blob",
                "peak storage ÷ fp32 model",
            ],
            rows,
        )
    )
