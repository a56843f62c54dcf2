"""The page's section 8, real text over seeds (``bench_text.py --mode
defaults|repeat|rerun``'s results): the defaults against the previous ones, and whether a
run repeats."""

import statistics
from pathlib import Path
from typing import Any

from _page import Page, load, num, provenance, spread, table
from report_text import TEXT_SIZES

TEXT_SEED_MODES = {
    "defaults": "### The defaults on real text, three seeds",
    "repeat": "### Repeatability: the defaults, two learners, plain SGD, five seeds",
    "rerun": "### Repeatability: the same run five times (only the timing differs)",
}


def text_seed_results(results: Path) -> dict[str, Any] | None:
    """``bench_text --mode defaults|repeat|rerun``'s results, the largest size measured of each
    (``quick`` last: the smoke-test size)."""
    found = {}
    for mode in TEXT_SEED_MODES:
        for size in (*TEXT_SIZES, "quick"):
            result = load(results, f"text-{mode}-{size}")
            if result is not None:
                found[mode] = result
                break
    return found or None


def _config_words(config: dict[str, Any]) -> str:
    return (
        f"F={config['fragments']} (`{config['pattern']}`), H={config['sync_every']}, outer "
        f"{config['outer_lr']} / {config['outer_momentum']}, quorum "
        f"{config['quorum_fraction']} / grace {config['grace']} s"
        + (f", overlap {config['overlap']}" if config.get("overlap") is not None else ", unpaced")
    )


def text_seeds(page: Page, by_mode: dict[str, Any] | None) -> None:
    """The real-text task over seeds: the defaults against the previous ones, and the
    repeatability check (``benchmarks/bench_text_seeds.py``)."""
    page.add("## 8. Real text over seeds: the defaults and repeatability", "")
    if by_mode is None:
        page.add(
            "_Not measured: no `benchmarks/results/text-{defaults,repeat,rerun}-*.json` "
            "(`benchmarks/bench_text.py --size medium --mode defaults|repeat|rerun`)._",
            "",
        )
        return
    for mode, title in TEXT_SEED_MODES.items():
        result = by_mode.get(mode)
        page.add(title, "")
        if result is None:
            page.add(f"_Not measured: `--mode {mode}`._", "")
            continue
        _mode(page, result)


def row_order(label: str) -> tuple[int, int]:
    """A row of a seeds mode in order: its seed, then its rerun (``seed#run``)."""
    seed, _, rerun = label.partition("#")
    return int(seed), int(rerun or 0)


def _mode(page: Page, result: dict[str, Any]) -> None:
    """One mode: its rows, the figures over them, and its targets."""
    p, figures = result["parameters"], result["figures"]
    per_seed, over, arms = figures["per_seed"], figures["over_seeds"], figures["arms"]
    configs = {
        arm: run["config"] for seed in arms.values() for arm, run in seed.items() if "config" in run
    }
    arm_names = sorted(over, key=lambda arm: ({"dp": 0, "single": 1}.get(arm, 2), arm))
    page.add(provenance(result), "", _setup(p, configs), "")
    page.add(*_rows_table(per_seed, arm_names), *_over_table(over, arm_names))
    paced = _paced_arms(over, configs)
    unpaced = [arm for arm in arm_names if arm.startswith("gm-") and arm not in paced]
    single = over.get("single", {}).get("excess_spread")
    if p.get("reruns") and unpaced:
        page.add(*_rerun_spread(over, unpaced))
        _paced(page, per_seed, over, paced, unpaced[0])
    elif single is not None:
        page.add(
            f"The single learner's own max/min excess over data-parallel, {num(single, 2)}, "
            "is the seed-to-seed noise of this measure without gradientmail in the loop: a "
            "spread near it is the task's, not the protocol's.",
            "",
        )
    _targets(page, p, over, paced)


def _setup(p: dict[str, Any], configs: dict[str, Any]) -> str:
    inner = (
        f"plain SGD at {p['inner_lr']} (gradient norm clipped to {p['sgd_clip']})"
        if p["inner"] == "sgd"
        else f"AdamW at {p['inner_lr']}"
    )
    model = p["model"]
    return (
        f"Section 6's task at size `{p['size']}` (d_model {model['d_model']}, "
        f"{model['n_layers']} layers, {p['params']:,} parameters, {p['steps']} steps per "
        f"learner, batch {p['batch']}): {p['learners']} learners, each on its "
        f"1/{p['learners']} of the training text, inner optimizer {inner} with warm-up and "
        "cosine decay; data-parallel trains one model on the union of their batches, the "
        "single learner trains on the first shard alone for the same steps (equal steps per "
        "learner). Each seed draws the initialization and every batch"
        + (
            f"; every row is seed {p['seeds'][0]} again (`seed#run`), so only the timing of "
            "the processes differs between them. "
            if p.get("reruns")
            else ". "
        )
        + "; ".join(f"`{arm}`: {_config_words(c)}" for arm, c in sorted(configs.items()))
        + "."
    )


def _cell(arm: str, entry: dict[str, Any] | None) -> str:
    """A row's figure for one arm (gradientmail's with its excess and its short rounds)."""
    if entry is None:
        return "–"
    text = num(entry["bits_per_byte"], 4)
    if arm.startswith("gm-") and "excess_over_dp" in entry:
        text += f" ({entry['excess_over_dp']:+.4f}"
        if "beats_single" in entry:
            text += ", beats single" if entry["beats_single"] else ", **not below single**"
        text += f"; {entry['rounds_without_all']}/{entry['rounds_committed']} rounds short)"
    return text


def _rows_table(per_seed: dict[str, Any], arm_names: list[str]) -> list[str]:
    rows = [
        [seed, *[_cell(arm, row.get(arm)) for arm in arm_names]]
        for seed, row in sorted(per_seed.items(), key=lambda item: row_order(item[0]))
    ]
    return [
        "Validation bits per byte per row (gradientmail: its excess over data-parallel of the "
        "same seed, and the rounds that closed without every learner):",
        "",
        *table(["seed", *arm_names], rows),
    ]


def _over_table(over: dict[str, Any], arm_names: list[str]) -> list[str]:
    rows = []
    for arm in arm_names:
        entry = over[arm]
        excess = entry.get("excess_over_dp")
        rows.append(
            [
                arm,
                spread(entry["bits_per_byte"], 4),
                num(entry.get("bits_per_byte_spread"), 3),
                spread(excess, 4) if excess else "–",
                num(entry.get("excess_spread"), 2),
                f"{entry['beats_single']} of {entry['runs']}" if "runs" in entry else "–",
            ]
        )
    header = ["arm", "bits/byte", "max/min bits/byte", "excess over DP", "max/min excess"]
    return [
        "Over the rows (median [min, max]; max/min excess: of the excesses' magnitudes when "
        "they share a sign, – when they straddle zero):",
        "",
        *table([*header, "runs below single"], rows),
    ]


def _rerun_spread(over: dict[str, Any], unpaced: list[str]) -> list[str]:
    """What spreads the reruns of one seed: the machine, and the unpaced arms' timing."""
    local = ", ".join(
        f"{arm}'s {num(over[arm]['bits_per_byte_spread'], 3)}"
        for arm in ("dp", "single")
        if arm in over
    )
    return [
        f"The local arms' max/min over the reruns ({local}) is this machine's own "
        "nondeterminism; what spreads an unpaced gradientmail's rows is the timing of its "
        "processes alone: standard deviation "
        + ", ".join(
            f"{num(over[arm]['bits_per_byte']['stdev'], 4)} bits/byte (`{arm}`)" for arm in unpaced
        )
        + ".",
        "",
    ]


def _paced(
    page: Page,
    per_seed: dict[str, Any],
    over: dict[str, Any],
    paced: dict[str, int],
    unpaced: str,
) -> None:
    """The ``paced`` arms of a rerun mode (``_paced_arms``) against the ``unpaced`` one:
    spread and wall."""

    def wall(arm: str) -> float:
        return statistics.median(row[arm]["wall_seconds"] for row in per_seed.values())

    if not paced:
        return
    lines = [
        f"`{arm}` (overlap {overlap}): final loss max/min "
        f"{num(over[arm]['bits_per_byte_spread'], 3)} (standard deviation "
        f"{num(over[arm]['bits_per_byte']['stdev'], 4)}), median wall "
        f"{num(wall(arm) / wall(unpaced), 2)}× `{unpaced}`'s"
        for arm, overlap in paced.items()
    ]
    page.add(
        "With rounds that pace the learners (`RunConfig.overlap`, docs/protocol.md) the "
        "timing no longer reaches the numbers: "
        + "; ".join(lines)
        + ". A smaller overlap waits more often for the round (the wall time), a larger one "
        "applies each round later.",
        "",
    )


def _paced_arms(over: dict[str, Any], configs: dict[str, Any]) -> dict[str, int]:
    """The gradientmail arms among ``over``'s whose runs set ``RunConfig.overlap``, with it,
    by overlap."""
    found = [(arm, configs.get(arm, {}).get("overlap")) for arm in over if arm.startswith("gm-")]
    return dict(sorted(((a, n) for a, n in found if n is not None), key=lambda item: item[1]))


def _targets(page: Page, p: dict[str, Any], over: dict[str, Any], paced: dict[str, int]) -> None:
    where = f"real text ({p['size']}, {p['learners']} learners, {p['inner']})"
    defaults = over.get("gm-defaults")
    if defaults is None or "runs" not in defaults:
        return
    page.target(
        f"{where}: gradientmail (defaults) below one learner alone, every "
        + ("run" if p.get("reruns") else "seed")
        + " (DiLoCo's ordering)",
        f"{defaults['runs']} of {defaults['runs']}",
        f"{defaults['beats_single']} of {defaults['runs']}",
        defaults["beats_single"] == defaults["runs"],
        "bench_text --mode " + p["mode"],
    )
    if p["mode"] in ("repeat", "rerun"):
        _spread_targets(page, p, over, paced, where)
    previous = over.get("gm-previous")
    if previous is not None and "excess_over_dp" in previous:
        ours, theirs = (
            defaults["excess_over_dp"]["median"],
            previous["excess_over_dp"]["median"],
        )
        page.target(
            f"{where}: new defaults' excess over DP against the previous defaults'",
            "≤ the previous (median over seeds)",
            f"{num(ours, 4)} vs {num(theirs, 4)} bits/byte",
            ours <= theirs,
            "bench_text --mode defaults",
        )


def _spread_targets(
    page: Page, p: dict[str, Any], over: dict[str, Any], paced: dict[str, int], where: str
) -> None:
    """The repeatability targets: the defaults' spreads, and each paced arm's."""
    defaults, by = over["gm-defaults"], "bench_text --mode " + p["mode"]
    over_what = "reruns of one seed" if p.get("reruns") else "seeds"
    excess_spread, excess = defaults.get("excess_spread"), defaults["excess_over_dp"]
    measured = (
        num(excess_spread, 2)
        if excess_spread is not None
        else f"undefined: excess {num(excess['min'], 4)} to {num(excess['max'], 4)} "
        "bits/byte (straddles DP's loss)"
    )
    page.target(
        f"{where}: spread of the excess over DP, max/min over {over_what}",
        f"≤ {p['spread_max']}",
        measured,
        excess_spread is not None and excess_spread <= p["spread_max"],
        by,
    )
    page.target(
        f"{where}: spread of the final loss, max/min over {over_what}",
        f"≤ {p['spread_max']}",
        f"{num(defaults['bits_per_byte_spread'], 3)} (DP's "
        f"{num(over['dp']['bits_per_byte_spread'], 3)})",
        defaults["bits_per_byte_spread"] <= p["spread_max"],
        by,
    )
    for arm, overlap in paced.items():
        if arm == "gm-defaults":
            continue
        arm_spread = over[arm].get("excess_spread")
        page.target(
            f"{where}: with overlap {overlap}, spread of the excess over DP, "
            f"max/min over {over_what}",
            f"≤ {p['spread_max']}",
            num(arm_spread, 2) if arm_spread is not None else "undefined (straddles DP's loss)",
            arm_spread is not None and arm_spread <= p["spread_max"],
            by,
        )
