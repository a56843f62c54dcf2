"""The page's section 1, convergence and bytes against data-parallel
(``bench_convergence.py``'s results), with the notes on each missed target."""

from typing import Any

from _page import Page, byte_size, num, provenance, spread, table

ARM_LABEL = {"dp": "data-parallel (reference)", "single": "single learner"}
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def arm_order(arm: str) -> tuple[int, str, int]:
    """The arms in the page's order: data-parallel, single, then by encoding and H."""
    if arm in ("dp", "single"):
        return (0 if arm == "dp" else 1, "", 0)
    _, encoding, sync = arm.split("-")
    return (2, {"fp32": "a", "int8": "b", "int4": "c"}.get(encoding, encoding), int(sync[1:]))


def _seeding(p: dict[str, Any]) -> str:
    """Which arms ran over which seeds, as a sentence fragment."""
    seeds = ", ".join(map(str, p["seeds"]))
    repeated = p.get("repeated")
    if len(p["seeds"]) == 1 or repeated is None:
        return f"Seed{'s' if len(p['seeds']) > 1 else ''} {seeds} for every arm"
    labels = ", ".join(ARM_LABEL.get(arm, arm) for arm in ["dp", "single", *repeated])
    return (
        f"Seeds {seeds} for {labels}; the rest of the gradientmail matrix on seed "
        f"{p['seeds'][0]} only (the whole matrix over every seed does not fit the time budget)"
    )


def convergence(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 1. Convergence and bytes", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/convergence.json` is missing._", "")
        return
    p = result["parameters"]
    figures = result["figures"]
    arms = figures["arms"]
    page.add(provenance(result), "", *_intro(p), *_arms_table(arms))
    floors = sorted(
        {round(r["floor"], 4) for seeds_ in figures["per_seed"].values() for r in seeds_.values()}
    )
    page.add(f"Entropy floors of the seeds' languages (nats): {', '.join(map(str, floors))}.", "")
    _plot_curves(page, figures)
    gm = [arm for arm in arms if arm.startswith("gm-")]
    if gm:
        _plot_bytes(page, arms, gm)
        page.add(*_kinds_table(figures, gm))
    _targets(page, figures)
    page.add(*_notes(p, figures))
    _gap_targets(page, figures, gm)


def _intro(p: dict[str, Any]) -> list[str]:
    return [
        f"The demo's transformer ({p['model']}, {p['params']:,} parameters) learns the demo's "
        f"Markov language (exact entropy floor known) for {p['steps']} steps with batch "
        f"{p['batch_per_learner']} × {p['context']} tokens per learner, AdamW at "
        f"{p['lr']}, warm-up then cosine decay. Data-parallel trains one model on "
        f"{p['learners']} × {p['batch_per_learner']} sequences per step (the union of the "
        f"learners' batches); gradientmail runs {p['learners']} learner processes and a "
        f"dedicated syncer process on a `LocalMailbox`, {p['fragments']} fragments, "
        f"sync_every H; the single learner trains on learner 0's batches alone. "
        f"{_seeding(p)}; each "
        "seed draws its own language, initial weights and data streams, and every ratio is "
        "taken against data-parallel of the same seed. Cells show the median over seeds and "
        "[min, max] (a single value: one seed). The model and the step count are small so "
        "that the whole matrix runs in the time budget on two cores; the ratios, not the "
        "absolute losses, are the result.",
        "",
        "Data-parallel's bytes are **computed**: a ring all-reduce of fp32 gradients moves "
        "2(K − 1)/K × 4 bytes × parameters per learner per step. gradientmail's are "
        "**measured**: everything each learner process wrote to and read from the store "
        "(`node.state`), from the moment all learners had joined to the end of its closing "
        "flush; the dedicated syncer's traffic is reported apart and, in the last column, "
        "shared among the learners.",
        "",
    ]


def _arms_table(arms: dict[str, Any]) -> list[str]:
    rows = []
    for arm in sorted(arms, key=arm_order):
        entry = arms[arm]
        gm = arm.startswith("gm-")
        rows.append(
            [
                ARM_LABEL.get(arm, arm),
                spread(entry["final_loss"], 4),
                spread(entry["excess"], 4),
                spread(entry["excess_ratio_vs_dp"], 3) if arm != "dp" else "1",
                spread(entry["relative_gap_percent_vs_dp"], 2) if arm != "dp" else "0",
                byte_size(entry["bytes_per_learner"]["median"])
                if "bytes_per_learner" in entry
                else "–",
                spread(entry["bytes_ratio_dp_over_gm"], 0) if gm else "–",
                spread(entry["bytes_ratio_with_syncer_share"], 0) if gm else "–",
                spread(entry["mean_participants"], 2) if gm else "–",
            ]
        )
    return table(
        [
            "arm",
            "final eval loss",
            "excess over floor",
            "excess ÷ DP's",
            "loss gap vs DP (%)",
            "bytes per learner",
            "DP bytes ÷ gm bytes",
            "… with syncer share",
            "snapshots per round",
        ],
        rows,
    )


def _plot_curves(page: Page, figures: dict[str, Any]) -> None:
    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        for arm in sorted(figures["per_seed"], key=arm_order):
            runs = list(figures["per_seed"][arm].values())
            length = min(len(r["curve"]) for r in runs)
            xs = [runs[0]["curve"][i][0] * runs[0]["tokens_per_step"] for i in range(length)]
            ys = [
                sum(r["curve"][i][1] - r["floor"] for r in runs) / len(runs) for i in range(length)
            ]
            style = {"dp": "k-", "single": "k:"}.get(arm, "-")
            axes.plot(xs, ys, style, label=ARM_LABEL.get(arm, arm), linewidth=1.2)
        axes.set_xlabel("tokens processed by the arm (all learners)")
        axes.set_ylabel("eval loss − entropy floor (nats, mean over seeds)")
        axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
        axes.set_title("Excess evaluation loss against tokens")

    page.plot("convergence.png", draw, "excess loss against tokens for every arm")


def _plot_bytes(page: Page, arms: dict[str, Any], gm: list[str]) -> None:
    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        encodings = sorted({arm.split("-")[1] for arm in gm}, key=lambda e: arm_order(f"gm-{e}-H0"))
        for encoding in encodings:
            points = sorted(
                (int(arm.split("-")[2][1:]), arms[arm]["bytes_ratio_dp_over_gm"]["median"])
                for arm in gm
                if arm.split("-")[1] == encoding
            )
            axes.plot([x for x, _ in points], [y for _, y in points], "o-", label=encoding)
        axes.set_xlabel("sync_every H (steps)")
        axes.set_ylabel("DP bytes ÷ gradientmail bytes per learner")
        axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend()
        axes.set_title("Bytes saved against data-parallel")

    page.plot("bytes.png", draw, "bytes ratio against sync_every per encoding")


def _bytes_by_kind(runs: list[dict[str, Any]]) -> dict[str, float]:
    """A learner's bytes by ``direction:kind``, the mean over ``runs``."""
    kinds: dict[str, float] = {}
    for r in runs:
        for kind, n in r.get("bytes_by_kind_per_learner", {}).items():
            kinds[kind] = kinds.get(kind, 0.0) + n / len(runs)
    return kinds


def _kinds_table(figures: dict[str, Any], gm: list[str]) -> list[str]:
    rows = []
    for arm in sorted(gm, key=arm_order):
        runs = list(figures["per_seed"][arm].values())
        kinds = _bytes_by_kind(runs)
        total = sum(kinds.values())
        if not total:
            continue
        payload = kinds.get("up:blobs", 0.0) + kinds.get("down:blobs", 0.0)
        rows.append(
            [
                arm,
                byte_size(total),
                f"{100 * payload / total:.1f}%",
                ", ".join(
                    f"{kind} {100 * n / total:.1f}%"
                    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1])
                    if n / total >= 0.005
                ),
                byte_size(sum(r["syncer_bytes"] for r in runs) / len(runs)),
            ]
        )
    if not rows:
        return []
    return [
        "Where a learner's bytes go (mean over seeds; `blobs` are the encoded deltas it "
        "uploads and the updates or θ it downloads, the rest is protocol metadata: "
        "snapshot objects, round records, leases):",
        "",
        *table(
            ["arm", "learner bytes", "payload share", "by direction:kind", "syncer bytes"], rows
        ),
    ]


def _targets(page: Page, figures: dict[str, Any]) -> None:
    for target in figures["targets"]:
        arm = target["arm"]
        excess_what, bytes_what = f"{arm}: excess loss ÷ DP's", f"{arm}: DP bytes ÷ gm bytes"
        excess_max = f"≤ {target['excess_ratio_max']:.2f}"
        bytes_min = f"≥ {target['bytes_ratio_min']:.0f}×"
        if not target["measured"]:
            page.target(excess_what, excess_max, "–", None, "")
            page.target(bytes_what, bytes_min, "–", None, "")
            continue
        entry = figures["arms"][arm]
        excess, bytes_ = target["excess_ratio"], target["bytes_ratio"]
        page.target(
            excess_what,
            excess_max,
            spread(entry["excess_ratio_vs_dp"], 3),
            target["excess_met"],
            ""
            if target["excess_met"]
            else f"{100 * (excess / target['excess_ratio_max'] - 1):.1f}% over",
        )
        page.target(
            bytes_what,
            bytes_min,
            spread(entry["bytes_ratio_dp_over_gm"], 0) + "×",
            target["bytes_met"],
            ""
            if target["bytes_met"]
            else f"{100 * (1 - bytes_ / target['bytes_ratio_min']):.1f}% short",
        )


def _gap_targets(page: Page, figures: dict[str, Any], gm: list[str]) -> None:
    published = figures["published_gap_percent"]
    for arm in sorted(gm, key=arm_order):
        if arm in {t["arm"] for t in figures["targets"]}:
            gap = figures["arms"][arm]["relative_gap_percent_vs_dp"]
            page.target(
                f"{arm}: loss gap vs DP",
                f"≤ +{published}% (published, 4 replicas)",
                spread(gap, 2) + "%",
                gap["median"] <= published,
                ""
                if gap["median"] <= published
                else f"{num(gap['median'] - published, 2)} points over",
            )


def _notes(p: dict[str, Any], figures: dict[str, Any]) -> list[str]:
    """Why each missed convergence target was missed, from the measured breakdowns."""
    lines: list[str] = []
    for target in figures["targets"]:
        if not target["measured"]:
            continue
        if not target["excess_met"]:
            lines += [_excess_note(p, figures, target), ""]
        if not target["bytes_met"]:
            lines += [_bytes_note(p, figures, target), ""]
    return lines + _closing_note(p, figures)


def _excess_note(p: dict[str, Any], figures: dict[str, Any], target: dict[str, Any]) -> str:
    arms, k, steps = figures["arms"], p["learners"], p["steps"]
    arm = target["arm"]
    _, encoding, sync = arm.split("-")
    h_steps = int(sync[1:])
    entry = arms[arm]
    text = (
        f"**{arm}, excess loss**: {num(target['excess_ratio'], 2)}× data-parallel's "
        f"against a target of {target['excess_ratio_max']:.2f}×, "
        f"{100 * (target['excess_ratio'] / target['excess_ratio_max'] - 1):.0f}% over. "
    )
    fp32 = arms.get(f"gm-fp32-H{h_steps}")
    if fp32 is not None and encoding != "fp32":
        text += _encoding_share(fp32["excess_ratio_vs_dp"]["median"], encoding, target, h_steps)
    ratios = entry["excess_ratio_vs_dp"]
    if ratios["n"] > 1:
        text += (
            f"The seeds spread from {num(ratios['min'], 2)}× to "
            f"{num(ratios['max'], 2)}×, so three seeds pin the median only roughly. "
        )
    rounds = entry["rounds_committed"]["median"] / p["fragments"]
    participants = entry["mean_participants"]["median"]
    text += (
        f"In {steps} steps each fragment takes only about {num(rounds, 1)} outer "
        "steps (rounds, the closing flush's included)"
    )
    if participants < k:
        return text + (
            f", and a round averaged {num(participants, 2)} of {k} learners' "
            "snapshots: a learner whose snapshot lands after its round closed (four "
            "learner processes and a syncer share two busy cores, so they drift "
            "apart) merges that progress locally and offers it again a round later."
        )
    return text + f"; every round averaged all {k} learners' snapshots."


def _encoding_share(same: float, encoding: str, target: dict[str, Any], h_steps: int) -> str:
    """How much of an arm's excess its encoding accounts for, given the fp32 arm's ratio at
    the same H (``same``)."""
    if same <= 1.0:
        return (
            f"With fp32 deltas and updates at the same H the ratio is "
            f"{num(same, 2)}×, no worse than data-parallel, which points to the "
            f"{encoding} encoding: its quantization error enters every delta "
            "and every update. "
        )
    return (
        f"With fp32 deltas and updates at the same H the ratio is "
        f"{num(same, 2)}×, so the {encoding} encoding accounts for "
        f"{num(target['excess_ratio'] - same, 2)} of it and synchronizing "
        f"every {h_steps} steps for the rest. "
    )


def _bytes_note(p: dict[str, Any], figures: dict[str, Any], target: dict[str, Any]) -> str:
    k, steps, arm = p["learners"], p["steps"], target["arm"]
    _, encoding, sync = arm.split("-")
    h_steps = int(sync[1:])
    runs = list(figures["per_seed"][arm].values())
    kinds = _bytes_by_kind(runs)
    total = sum(kinds.values())
    payload = kinds.get("up:blobs", 0.0) + kinds.get("down:blobs", 0.0)
    per_param = BYTES_PER_PARAM[encoding]
    ideal = 2 * (k - 1) / k * 4 * steps / (2 * per_param * steps / h_steps)
    syncs = steps / h_steps
    rounds = sum(r["rounds_committed"] for r in runs) / len(runs)
    carried = [[x for x in r["syncer"]["rounds"] if any(x["steps"].values())] for r in runs]
    stepped = sum(len(c) for c in carried) / len(runs)
    per_round = sum(sum(x["steps"].values()) / len(x["steps"]) for c in carried for x in c) / max(
        1, sum(len(c) for c in carried)
    )
    published = [
        learner["events"].get("snapshot_published", 0)
        for run in runs
        for learner in run["learners"]
    ]
    blob = kinds.get("up:blobs", 0.0) / max(1.0, sum(published) / len(published))
    raw = per_param * p["params"] / p["fragments"]
    return (
        f"**{arm}, bytes**: data-parallel moves {num(target['bytes_ratio'], 0)}× the "
        f"bytes against a target of {target['bytes_ratio_min']:.0f}×, "
        f"{100 * (1 - target['bytes_ratio'] / target['bytes_ratio_min']):.0f}% short. "
        f"Exactly one {encoding} copy of the model each way per H steps, and nothing "
        f"else, would give {num(ideal, 0)}× ({per_param:g} byte"
        f"{'' if per_param == 1 else 's'} per parameter). Measured, against that: "
        f"each fragment went through {num(rounds / p['fragments'], 2)} rounds for "
        f"{num(syncs, 1)} syncs in {steps} steps: {num(stepped / p['fragments'], 2)} "
        f"that carried steps, {num(per_round, 1)} steps per participant on the mean "
        f"against H = {h_steps}, and {num((rounds - stepped) / p['fragments'], 2)} of the "
        f"closing flush with none, which {steps} steps do not amortize (docs/protocol.md, "
        '"Fleets of unequal machines", says why a round carries fewer than H steps on this '
        "task); an encoded fragment is "
        f"{byte_size(blob)} for {byte_size(raw)} of {encoding} values "
        f"(+{100 * (blob / raw - 1):.0f}%: the block scales and the safetensors "
        "header with the blob's metadata); and "
        f"{100 * (1 - payload / total):.0f}% of a learner's bytes are protocol "
        "metadata (round records, snapshot objects, leases). The last two shrink as "
        f"the model grows (this one has {p['params']:,} parameters)."
    )


def _closing_note(p: dict[str, Any], figures: dict[str, Any]) -> list[str]:
    """How each arm's excess moved between its last checkpoint and the end (mean over
    seeds): for gradientmail the end is after the closing flush."""
    change: dict[str, float] = {}
    for arm, seeds in figures["per_seed"].items():
        deltas = [
            (r["curve"][-1][1] - r["curve"][-2][1]) for r in seeds.values() if len(r["curve"]) > 2
        ]
        if deltas:
            change[arm] = sum(deltas) / len(deltas)
    rose = sorted(
        (arm for arm, d in change.items() if d > 0 and arm.startswith("gm-")), key=arm_order
    )
    if "dp" not in change or not rose:
        return []
    last = int(figures["per_seed"]["dp"][next(iter(figures["per_seed"]["dp"]))]["curve"][-2][0])
    return [
        f"**The close**: from the last checkpoint (step {last}) to the end (step "
        f"{p['steps']}), data-parallel's evaluation loss changed by "
        f"{num(change['dp'], 4)} nats (mean over seeds), but it rose for "
        + ", ".join(
            f"{arm} ({'+' if change[arm] > 0 else ''}{num(change[arm], 4)})" for arm in rose
        )
        + ". A learner's final model is what it holds after the closing flush, whose "
        "rounds apply the outer Nesterov step, with the momentum built over the run, to the "
        "deltas of the last few (low learning-rate) steps; the final figures above include "
        "that. (The final loss is measured on a held-out set four times the checkpoints' "
        "that contains it, so part of this change is the larger set.)",
        "",
    ]
