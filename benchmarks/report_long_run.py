"""The page's section 10, bytes over a long run with the syncer's share
(``bench_convergence.py --long``'s results)."""

from typing import Any

from _page import Page, byte_size, num, provenance, table

BYTES_TARGET = 75.0
"""The target: data-parallel's bytes ÷ gradientmail's with the syncer's share, int8, H = 50."""


def convergence_bytes(page: Page, result: dict[str, Any] | None) -> None:
    """Bytes over a long run (``bench_convergence.py --long``), per ``checkpoint_every``."""
    page.add("## 10. Bytes over a long run, with the syncer's share", "")
    if result is None:
        page.add(
            "_Not measured: `benchmarks/results/convergence-bytes.json` is missing "
            "(`.venv/bin/python benchmarks/bench_convergence.py --long 2400`)._",
            "",
        )
        return
    p, figures = result["parameters"], result["figures"]
    page.add(
        provenance(result),
        "",
        f"The convergence benchmark's model ({p['params']:,} parameters) and {p['learners']} "
        f"learners at {p['encoding']}, H = {p['sync_every']}, {p['fragments']} fragments, run "
        f"for {p['steps']} steps (seed {p['seed']}): long enough that the closing flush (its "
        "final rounds) is a small share of a learner's bytes, given in the table. "
        "Data-parallel's bytes per learner are computed as in section 1 "
        f"({byte_size(figures['dp_bytes_per_learner'])}). The syncer's bytes are everything its "
        "process wrote and read; shared among the learners they make the last ratio.",
        "",
    )
    page.add(*_runs_table(figures["runs"]))
    _default(page, p, figures)


def _runs_table(runs: dict[str, Any]) -> list[str]:
    rows = [
        [
            every,
            str(run["rounds_committed"]),
            byte_size(run["bytes_per_learner"]),
            num(100 * run["closing_bytes_per_learner"] / run["bytes_per_learner"], 1),
            byte_size(run["syncer_up"]),
            byte_size(run["syncer_down"]),
            num(run["ratio_per_learner"], 0),
            num(run["ratio_with_syncer_share"], 0),
        ]
        for every, run in sorted(runs.items(), key=lambda item: int(item[0]))
    ]
    header = ["checkpoint_every", "rounds", "bytes per learner", "closing flush %"]
    header += ["syncer up", "syncer down", "DP ÷ learner", "DP ÷ (learner + syncer ÷ K)"]
    return table(header, rows)


def _default(page: Page, p: dict[str, Any], figures: dict[str, Any]) -> None:
    """The default ``checkpoint_every``'s bytes per round, and the target on it."""
    from gradientmail.protocol.records import RunConfig

    default = str(p.get("default_checkpoint_every", RunConfig().checkpoint_every))
    what = (
        f"DP bytes ÷ gradientmail's with the syncer's share (int8, H = 50, "
        f"checkpoint_every {default})"
    )
    if default not in figures["runs"]:
        page.add(
            f"The default `checkpoint_every` ({default}) is not among the values measured "
            f"({', '.join(figures['runs'])}): its bytes per round were not measured here.",
            "",
        )
        page.target(
            what,
            f"≥ {BYTES_TARGET:.0f}×",
            "–",
            "not measured at the default",
            "Bytes over a long run",
        )
        return
    run = figures["runs"][default]
    ratio = run["ratio_with_syncer_share"]
    rounds = run["rounds_committed"]
    syncer = run["syncer_up"] + run["syncer_down"]
    closing = 100 * run["closing_bytes_per_learner"] / run["bytes_per_learner"]
    steady = figures["dp_bytes_per_learner"] / (
        run["bytes_per_learner"] - run["closing_bytes_per_learner"] + syncer / p["learners"]
    )
    page.add(
        f"With the default `checkpoint_every` ({default}), per round a learner moved "
        f"{byte_size(run['bytes_per_learner'] / rounds)} and the syncer "
        f"{byte_size(syncer / rounds)} ({byte_size(run['syncer_up'] / rounds)} up: the update and "
        f"1/{default} of a checkpoint; the rest down: the learners' deltas and the metadata "
        "of the round). Without the learners' closing flush (their bytes after their last "
        f"training step, {num(closing, 1)} % of them; the syncer's share of the closing "
        "rounds is not separated), data-parallel's "
        f"bytes ÷ gradientmail's with the syncer's share is {steady:.0f}×.",
        "",
    )
    page.target(
        what,
        f"≥ {BYTES_TARGET:.0f}×",
        f"{ratio:.0f}×",
        ratio >= BYTES_TARGET,
        "Bytes over a long run",
    )
