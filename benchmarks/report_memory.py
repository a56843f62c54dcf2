"""The page's section 12, peak memory and round latency of large fragments
(``bench_memory.py``'s results)."""

from typing import Any

from _page import Page, byte_size, num, provenance, table


def large_fragments(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 12. Memory and round latency of large fragments", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/memory.json` is missing._", "")
        page.target("peak memory against P", "linear, at the bound", "–", None, "not run")
        return
    f = result["figures"]
    page.add(
        provenance(result),
        "",
        "Each point is a fresh process that first builds what its role holds between "
        "rounds, then runs one operation through the node's own code; the figure is its "
        "peak resident set (`VmHWM`, reset once the setup is done) above the resident set "
        "it started from, per parameter of the fragment. `publish`: a learner holding its "
        "fragment and base (fp32) copies the snapshot out, encodes S − B at int8 and its "
        "norm and uploads the blob to a `LocalMailbox`; bound 4 + b bytes per parameter (the "
        "snapshot, the blob; b = 1 + 4/256 at int8, block 256). `close`: a syncer holding "
        f"θ and the momentum downloads K = {result['parameters']['snapshots']} int8 snapshot "
        "blobs, aggregates, steps, encodes the update and θ′ and the momentum (fp32) and "
        "uploads them; bound 20 + (K + 1)·b (the snapshots and the update encoded, the "
        "mean, θ′, the momentum′ and their two fp32 blobs; never a decoded delta). Both add "
        "a constant of a few pieces of 4M elements.",
        "",
    )
    page.add(*_points_table(f["memory"]))
    _fits(page, f["memory"])
    page.add("")
    if f.get("latency"):
        page.add(*_latency(f["latency"]))


def _points_table(memory: dict[str, Any]) -> list[str]:
    rows = [
        [
            role,
            f"{int(size):,}",
            byte_size(point["start"]),
            byte_size(point["peak"]),
            num(point["above_start_per_param"], 2),
            num(point["seconds"], 2),
        ]
        for role, entry in memory.items()
        for size, point in entry["points"].items()
    ]
    return table(["role", "parameters", "start", "peak", "above start, B/param", "seconds"], rows)


def _fits(page: Page, memory: dict[str, Any]) -> None:
    """Each role's least-squares fit against its bound, and the target on it."""
    for role, entry in memory.items():
        fit = entry["fit_above_start"]
        page.add(
            f"- `{role}`: least-squares slope **{num(fit['slope'], 2)} bytes per parameter** "
            f"above the held state (bound {num(entry['bound_per_param'], 2)}), intercept "
            f"{byte_size(max(fit['intercept'], 0.0))}, R² {num(fit['r2'], 4)}; whole-process "
            f"slope {num(entry['fit_peak']['slope'], 2)} B/param."
        )
        page.target(
            f"peak memory of `{role}` against P",
            f"linear (R² > 0.99), slope within 10% of the bound "
            f"{num(entry['bound_per_param'], 2)} B/param",
            f"{num(fit['slope'], 2)} B/param, R² {num(fit['r2'], 3)}",
            fit["r2"] > 0.99 and fit["slope"] <= 1.1 * entry["bound_per_param"],
            "no whole temporary copy: the pieces are the constant part",
        )


def _latency(latency: dict[str, Any]) -> list[str]:
    return [
        f"**Round latency** of a run of one fragment of {latency['size']:,} parameters "
        f"(int8 deltas and updates) on a `LocalMailbox`: {latency['learners']} "
        "learner-only processes and one syncer-only process, from a round's last "
        "snapshot landing to the first learner seeing its record (wall clock, one "
        "machine, poll 50 ms). It spans the syncer's reads of the snapshots, the "
        "aggregation, the outer step, the update and the fp32 θ and outer state written, "
        "and the record.",
        "",
        *table(
            ["rounds", "p50", "max", "first round", "syncer peak", "learner peak"],
            [
                [
                    str(len(latency["values_s"])),
                    f"{num(latency['p50_s'], 2)} s",
                    f"{num(latency['max_s'], 2)} s",
                    f"{num(latency['first_round_s'], 2)} s",
                    f"{num(latency['syncer_peak_per_param'], 1)} B/param",
                    f"{num(latency['learner_peak_per_param'], 1)} B/param",
                ]
            ],
        ),
    ]
