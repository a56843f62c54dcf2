"""Generate ``docs/benchmarks.md`` and its plots from the result files.

Every number in the page comes from ``<results>/*.json``; nothing is typed by hand. A
missing result file leaves its section saying so. Plots are PNGs written next to the page
(``docs/benchmarks/``).

Usage: ``.venv/bin/python benchmarks/report.py [--results DIR] [--docs DIR]``.
"""

import argparse
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness as h
import bench_text
import report_fair
import report_fleet
from _page import Page
from _page import byte_size as _bytes
from _page import load as _load
from _page import num as _num
from _page import provenance as _provenance
from _page import spread as _spread
from _page import table as _table

PAGE = "benchmarks.md"


# -- sections ---------------------------------------------------------------------------


_ARM_LABEL = {"dp": "data-parallel (reference)", "single": "single learner"}


def _arm_order(arm: str) -> tuple[int, str, int]:
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
    labels = ", ".join(_ARM_LABEL.get(arm, arm) for arm in ["dp", "single", *repeated])
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
    page.add(
        _provenance(result),
        "",
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
    )
    rows = []
    for arm in sorted(arms, key=_arm_order):
        entry = arms[arm]
        rows.append(
            [
                _ARM_LABEL.get(arm, arm),
                _spread(entry["final_loss"], 4),
                _spread(entry["excess"], 4),
                _spread(entry["excess_ratio_vs_dp"], 3) if arm != "dp" else "1",
                _spread(entry["relative_gap_percent_vs_dp"], 2) if arm != "dp" else "0",
                _bytes(entry["bytes_per_learner"]["median"])
                if "bytes_per_learner" in entry
                else "–",
                _spread(entry["bytes_ratio_dp_over_gm"], 0) if arm.startswith("gm-") else "–",
                _spread(entry["bytes_ratio_with_syncer_share"], 0)
                if arm.startswith("gm-")
                else "–",
                _spread(entry["mean_participants"], 2) if arm.startswith("gm-") else "–",
            ]
        )
    page.add(
        *_table(
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
    )
    floors = sorted(
        {round(r["floor"], 4) for seeds_ in figures["per_seed"].values() for r in seeds_.values()}
    )
    page.add(f"Entropy floors of the seeds' languages (nats): {', '.join(map(str, floors))}.", "")

    def draw_curves(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        for arm in sorted(figures["per_seed"], key=_arm_order):
            runs = list(figures["per_seed"][arm].values())
            length = min(len(r["curve"]) for r in runs)
            xs = [runs[0]["curve"][i][0] * runs[0]["tokens_per_step"] for i in range(length)]
            ys = [
                sum(r["curve"][i][1] - r["floor"] for r in runs) / len(runs) for i in range(length)
            ]
            style = {"dp": "k-", "single": "k:"}.get(arm, "-")
            axes.plot(xs, ys, style, label=_ARM_LABEL.get(arm, arm), linewidth=1.2)
        axes.set_xlabel("tokens processed by the arm (all learners)")
        axes.set_ylabel("eval loss − entropy floor (nats, mean over seeds)")
        axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
        axes.set_title("Excess evaluation loss against tokens")

    page.plot("convergence.png", draw_curves, "excess loss against tokens for every arm")

    gm = [arm for arm in arms if arm.startswith("gm-")]
    if gm:

        def draw_bytes(figure: Any) -> None:
            axes = figure.add_subplot(1, 1, 1)
            encodings = sorted(
                {arm.split("-")[1] for arm in gm}, key=lambda e: _arm_order(f"gm-{e}-H0")
            )
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

        page.plot("bytes.png", draw_bytes, "bytes ratio against sync_every per encoding")

        rows = []
        for arm in sorted(gm, key=_arm_order):
            runs = list(figures["per_seed"][arm].values())
            kinds: dict[str, float] = {}
            for r in runs:
                for kind, n in r.get("bytes_by_kind_per_learner", {}).items():
                    kinds[kind] = kinds.get(kind, 0.0) + n / len(runs)
            total = sum(kinds.values())
            if not total:
                continue
            payload = kinds.get("up:blobs", 0.0) + kinds.get("down:blobs", 0.0)
            rows.append(
                [
                    arm,
                    _bytes(total),
                    f"{100 * payload / total:.1f}%",
                    ", ".join(
                        f"{kind} {100 * n / total:.1f}%"
                        for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1])
                        if n / total >= 0.005
                    ),
                    _bytes(sum(r["syncer_bytes"] for r in runs) / len(runs)),
                ]
            )
        if rows:
            page.add(
                "Where a learner's bytes go (mean over seeds; `blobs` are the encoded deltas it "
                "uploads and the updates or θ it downloads, the rest is protocol metadata: "
                "snapshot objects, round records, leases):",
                "",
                *_table(
                    ["arm", "learner bytes", "payload share", "by direction:kind", "syncer bytes"],
                    rows,
                ),
            )

    for target in figures["targets"]:
        arm = target["arm"]
        if not target["measured"]:
            page.target(
                f"{arm}: excess loss ÷ DP's", f"≤ {target['excess_ratio_max']:.2f}", "–", None, ""
            )
            page.target(
                f"{arm}: DP bytes ÷ gm bytes", f"≥ {target['bytes_ratio_min']:.0f}×", "–", None, ""
            )
            continue
        entry = arms[arm]
        excess, bytes_ = target["excess_ratio"], target["bytes_ratio"]
        page.target(
            f"{arm}: excess loss ÷ DP's",
            f"≤ {target['excess_ratio_max']:.2f}",
            _spread(entry["excess_ratio_vs_dp"], 3),
            target["excess_met"],
            ""
            if target["excess_met"]
            else f"{100 * (excess / target['excess_ratio_max'] - 1):.1f}% over",
        )
        page.target(
            f"{arm}: DP bytes ÷ gm bytes",
            f"≥ {target['bytes_ratio_min']:.0f}×",
            _spread(entry["bytes_ratio_dp_over_gm"], 0) + "×",
            target["bytes_met"],
            ""
            if target["bytes_met"]
            else f"{100 * (1 - bytes_ / target['bytes_ratio_min']):.1f}% short",
        )
    page.add(*_convergence_notes(p, figures))
    published = figures["published_gap_percent"]
    for arm in sorted(gm, key=_arm_order):
        if arm in {t["arm"] for t in figures["targets"]}:
            gap = arms[arm]["relative_gap_percent_vs_dp"]
            page.target(
                f"{arm}: loss gap vs DP",
                f"≤ +{published}% (published, 4 replicas)",
                _spread(gap, 2) + "%",
                gap["median"] <= published,
                ""
                if gap["median"] <= published
                else f"{_num(gap['median'] - published, 2)} points over",
            )


_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def _convergence_notes(p: dict[str, Any], figures: dict[str, Any]) -> list[str]:
    """Why each missed convergence target was missed, from the measured breakdowns."""
    arms, k, steps = figures["arms"], p["learners"], p["steps"]
    lines: list[str] = []
    for target in figures["targets"]:
        if not target["measured"]:
            continue
        arm = target["arm"]
        _, encoding, sync = arm.split("-")
        h_steps = int(sync[1:])
        entry = arms[arm]
        if not target["excess_met"]:
            text = (
                f"**{arm}, excess loss**: {_num(target['excess_ratio'], 2)}× data-parallel's "
                f"against a target of {target['excess_ratio_max']:.2f}×, "
                f"{100 * (target['excess_ratio'] / target['excess_ratio_max'] - 1):.0f}% over. "
            )
            fp32 = arms.get(f"gm-fp32-H{h_steps}")
            if fp32 is not None and encoding != "fp32":
                same = fp32["excess_ratio_vs_dp"]["median"]
                if same <= 1.0:
                    text += (
                        f"With fp32 deltas and updates at the same H the ratio is "
                        f"{_num(same, 2)}×, no worse than data-parallel, which points to the "
                        f"{encoding} encoding: its quantization error enters every delta "
                        "and every update. "
                    )
                else:
                    text += (
                        f"With fp32 deltas and updates at the same H the ratio is "
                        f"{_num(same, 2)}×, so the {encoding} encoding accounts for "
                        f"{_num(target['excess_ratio'] - same, 2)} of it and synchronizing "
                        f"every {h_steps} steps for the rest. "
                    )
            ratios = entry["excess_ratio_vs_dp"]
            if ratios["n"] > 1:
                text += (
                    f"The seeds spread from {_num(ratios['min'], 2)}× to "
                    f"{_num(ratios['max'], 2)}×, so three seeds pin the median only roughly. "
                )
            rounds = entry["rounds_committed"]["median"] / p["fragments"]
            participants = entry["mean_participants"]["median"]
            text += (
                f"In {steps} steps each fragment takes only about {_num(rounds, 1)} outer "
                "steps (rounds, the closing flush's included)"
            )
            if participants < k:
                text += (
                    f", and a round averaged {_num(participants, 2)} of {k} learners' "
                    "snapshots: a learner whose snapshot lands after its round closed (four "
                    "learner processes and a syncer share two busy cores, so they drift "
                    "apart) merges that progress locally and offers it again a round later."
                )
            else:
                text += f"; every round averaged all {k} learners' snapshots."
            lines += [text, ""]
        if not target["bytes_met"]:
            runs = list(figures["per_seed"][arm].values())
            kinds: dict[str, float] = {}
            for run in runs:
                for kind, n in run["bytes_by_kind_per_learner"].items():
                    kinds[kind] = kinds.get(kind, 0.0) + n / len(runs)
            total = sum(kinds.values())
            payload = kinds.get("up:blobs", 0.0) + kinds.get("down:blobs", 0.0)
            per_param = _BYTES_PER_PARAM[encoding]
            ideal = 2 * (k - 1) / k * 4 * steps / (2 * per_param * steps / h_steps)
            syncs = steps / h_steps
            rounds = sum(r["rounds_committed"] for r in runs) / len(runs)
            published = [
                learner["events"].get("snapshot_published", 0)
                for run in runs
                for learner in run["learners"]
            ]
            blob = kinds.get("up:blobs", 0.0) / max(1.0, sum(published) / len(published))
            raw = per_param * p["params"] / p["fragments"]
            lines += [
                f"**{arm}, bytes**: data-parallel moves {_num(target['bytes_ratio'], 0)}× the "
                f"bytes against a target of {target['bytes_ratio_min']:.0f}×, "
                f"{100 * (1 - target['bytes_ratio'] / target['bytes_ratio_min']):.0f}% short. "
                f"Exactly one {encoding} copy of the model each way per H steps, and nothing "
                f"else, would give {_num(ideal, 0)}× ({per_param:g} byte"
                f"{'' if per_param == 1 else 's'} per parameter). Measured, against that: "
                f"each fragment went through {_num(rounds / p['fragments'], 2)} rounds for "
                f"{_num(syncs, 1)} syncs in {steps} steps (the closing flush publishes every "
                "fragment's remaining steps, one more round for all but the last fragment, "
                f"which {steps} steps do not amortize); an encoded fragment is "
                f"{_bytes(blob)} for {_bytes(raw)} of {encoding} values "
                f"(+{100 * (blob / raw - 1):.0f}%: the block scales and the safetensors "
                "header with the blob's metadata); and "
                f"{100 * (1 - payload / total):.0f}% of a learner's bytes are protocol "
                "metadata (round records, snapshot objects, leases). The last two shrink as "
                f"the model grows (this one has {p['params']:,} parameters).",
                "",
            ]
    lines += _closing_note(p, figures)
    return lines


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
        (arm for arm, d in change.items() if d > 0 and arm.startswith("gm-")), key=_arm_order
    )
    if "dp" not in change or not rose:
        return []
    last = int(figures["per_seed"]["dp"][next(iter(figures["per_seed"]["dp"]))]["curve"][-2][0])
    return [
        f"**The close**: from the last checkpoint (step {last}) to the end (step "
        f"{p['steps']}), data-parallel's evaluation loss changed by "
        f"{_num(change['dp'], 4)} nats (mean over seeds), but it rose for "
        + ", ".join(
            f"{arm} ({'+' if change[arm] > 0 else ''}{_num(change[arm], 4)})" for arm in rose
        )
        + ". A learner's final model is what it holds after the closing flush, whose "
        "rounds apply the outer Nesterov step, with the momentum built over the run, to the "
        "deltas of the last few (low learning-rate) steps; the final figures above include "
        "that. (The final loss is measured on a held-out set four times the checkpoints' "
        "that contains it, so part of this change is the larger set.)",
        "",
    ]


def step_overhead(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 2. Step overhead", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/overhead.json` is missing._", "")
        return
    p, f = result["parameters"], result["figures"]
    page.add(
        _provenance(result),
        "",
        f"One training loop ({p['model']}, {p['params']:,} parameters, batch "
        f"{p['batch']} × {p['context']} tokens, AdamW) run bare and with a node (one "
        f"learner that is also its own syncer, `LocalMailbox`, F={p['fragments']}, "
        f"H={p['sync_every']}, `{p['encoding']}`), in segments of {p['segment_steps']} steps "
        f"that alternate between the two ({p['segments']} of each), driven from a worker "
        "thread through `node.run_in_thread` as a synchronous loop would be. The time of "
        "`step()` is measured on the caller, around each call.",
        "",
        *_table(
            ["figure", "value"],
            [
                ["steps/s, bare", _spread(f["steps_per_s_bare"], 2)],
                ["steps/s, with the node", _spread(f["steps_per_s_node"], 2)],
                ["ratio (node ÷ bare), median of segment pairs", _spread(f["ratio"], 3)],
                ["`step()` on the caller, p50", f"{_num(f['step_ms_p50'], 2)} ms"],
                ["`step()` on the caller, p99", f"{_num(f['step_ms_p99'], 2)} ms"],
                ["`step()` on the caller, max", f"{_num(f['step_ms_max'], 2)} ms"],
                ["training step, bare, p50", f"{_num(f['train_ms_p50'], 1)} ms"],
                ["rounds committed during the node segments", str(f["rounds_committed"])],
            ],
        ),
    )
    ratio = f["ratio"]["median"]
    if ratio < result["target_ratio"]:
        step_ms = 1e3 / f["steps_per_s_node"]["median"]
        caller = f["step_ms_mean"] / step_ms
        page.add(
            f"The target is missed by {100 * (result['target_ratio'] - ratio):.1f} points. "
            f"`step()` itself took {_num(f['step_ms_mean'], 2)} ms on average, "
            f"{100 * caller:.1f}% of a {_num(step_ms, 0)} ms step with the node; the rest "
            f"of the {100 * (1 - ratio):.1f}% is CPU time that the node's tasks take from "
            "the training on the same cores: encoding and hashing each snapshot and, as "
            "its own syncer, decoding, the outer step and writing θ, the outer state and "
            f"the update of each of the {f['rounds_committed']} rounds "
            f"({_bytes(f['bytes_published'])} written in all). The per-pair ratios "
            f"({', '.join(_num(v, 3) for v in f['ratio']['values'])}) show how much the "
            "shared machine's load moved between segments.",
            "",
        )
    if "idle" in f:
        page.add(
            "What a node costs while nothing happens (no steps; the product's lease pacing, "
            f"every {_num(p.get('idle_lease_every', 2.0), 0)} s): the CPU time of every "
            "thread of the process over "
            f"{_num(p['idle_seconds'], 0)} s, less the same process's with no node "
            f"({_num(f['idle_baseline_core_percent'], 2)}% of a core), in percent of one "
            "core. The learner lists the round records at every poll; the syncer reads the "
            "round it is closing (its record, its snapshots, and the next rounds' while it is "
            "empty). On a machine where training has every core, this is what it loses.",
            "",
            *_table(
                ["poll interval", "learner", "dedicated syncer"],
                [
                    [
                        f"{poll} s",
                        f"{_num(idle['learner_core_percent'], 2)}%",
                        f"{_num(idle['syncer_core_percent'], 2)}%",
                    ]
                    for poll, idle in f["idle"].items()
                ],
            ),
        )
    page.target(
        "step overhead: steps/s with node ÷ bare",
        f"≥ {result['target_ratio']}",
        _spread(f["ratio"], 3),
        f["ratio"]["median"] >= result["target_ratio"],
        ""
        if f["ratio"]["median"] >= result["target_ratio"]
        else f"{100 * (result['target_ratio'] - f['ratio']['median']):.1f} points under",
    )


def store(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 3. Store throughput", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/store.json` is missing._", "")
        return
    p, f = result["parameters"], result["figures"]
    page.add(
        _provenance(result),
        "",
        "`LocalMailbox` against plain file writes and reads of the same bytes (one worker-"
        "thread hop per operation, as the mailbox makes), and `S3Mailbox` against direct "
        "aiobotocore calls configured as the mailbox configures its client, on the same moto "
        "server on 127.0.0.1. Objects are written and read one at a time, each put to a fresh "
        f"key; {p['repetitions']} repetitions per figure ({p['list_repetitions']} for "
        f"`list`), the two arms alternating; `list` returns {p['list_keys']:,} keys. "
        "Ratio = mailbox throughput ÷ baseline throughput "
        "(medians); above 1 the mailbox is faster.",
        "",
    )
    rows = []
    bars: list[tuple[str, float]] = []
    misses: list[tuple[str, str, str, str, float, dict[str, Any] | None, bool]] = []
    for backend, stores in f.items():
        for name, sizes in stores.items():
            for size, entry in sizes.items():
                ops = ("list",) if size == "list" else ("put", "get")
                for op in ops:
                    if op == "list":
                        mailbox, baseline = (
                            entry["mailbox"]["keys_per_s"],
                            entry["baseline"]["keys_per_s"],
                        )
                        unit, value = "keys/s", entry["ratio"]
                        label = f"list {entry['keys']:,}"
                        spread = entry.get("ratio_per_repetition")
                    else:
                        measure = "mib_per_s" if entry["size_bytes"] >= 1 << 16 else "ops_per_s"
                        mailbox = entry[op]["mailbox"][measure]
                        baseline = entry[op]["baseline"][measure]
                        unit = "MiB/s" if measure == "mib_per_s" else "ops/s"
                        value = entry[op]["ratio"]
                        spread = entry[op].get("ratio_per_repetition")
                        label = f"{op} {size}"
                    rows.append(
                        [
                            backend,
                            name,
                            label,
                            f"{_num(mailbox['median'], 1)} {unit}",
                            f"{_num(baseline['median'], 1)} {unit}",
                            _num(value, 2),
                            f"{_num(spread['min'], 2)} – {_num(spread['max'], 2)}"
                            if spread
                            else "–",
                        ]
                    )
                    bars.append((f"{backend} {name} {label}", value))
                    if value is not None and value < result["target_ratio"]:
                        small = op == "list" or entry["size_bytes"] < 1 << 16
                        misses.append((backend, name, op, size, value, spread, small))
    page.add(
        *_table(
            ["loop", "store", "operation", "mailbox", "baseline", "ratio", "per repetition"],
            rows,
        )
    )

    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        labels = [label for label, _ in bars]
        values = [value for _, value in bars]
        colors = ["tab:green" if v >= result["target_ratio"] else "tab:red" for v in values]
        axes.barh(range(len(values)), values, color=colors)
        axes.set_yticks(range(len(values)), labels, fontsize=6)
        axes.axvline(result["target_ratio"], color="k", linestyle="--", linewidth=0.8)
        axes.axvline(1.0, color="grey", linewidth=0.5)
        axes.invert_yaxis()
        axes.set_xlabel("mailbox throughput ÷ baseline throughput (dashed: target)")
        axes.set_title("Store throughput ratios")

    page.plot("store.png", draw, "store throughput ratios")
    if misses:
        page.add(*_store_notes(misses, result["target_ratio"]))
    for name, worst in result["worst"].items():
        page.target(
            f"store throughput: {name} ÷ baseline, worst case",
            f"≥ {result['target_ratio']}",
            f"{_num(worst['ratio'], 2)} ({worst['where'].replace('list list', 'list')})",
            worst["ratio"] >= result["target_ratio"],
            ""
            if worst["ratio"] >= result["target_ratio"]
            else f"{100 * (1 - worst['ratio'] / result['target_ratio']):.0f}% under",
        )


_STORE_CAUSES = {
    ("local", "put"): "each put writes the bytes to a temporary file, hard-links it into "
    "place (the create-once guarantee: a concurrent writer of the same key loses cleanly) "
    "and unlinks the temporary name: two more file-system calls than the baseline's "
    "open-write-close, a cost per object that weighs most on small objects",
    ("local", "put", "large"): "the bytes are written once either way (the mailbox to a "
    "temporary name that it then hard-links into place), so at this size the three extra "
    "file-system calls per object (a check that the key is free, the link, the unlink) are "
    "a small share; the per-repetition spread shows how much the shared machine's load "
    "moved between the arms' turns",
    ("local", "get"): "a get is the baseline's open and read plus the key check and the "
    "key-to-path mapping; the difference is small against the per-repetition spread",
    ("local", "list"): "the baseline is one `os.listdir` and a sort of names; the mailbox "
    "reads every directory of the key layout below the prefix the same way, tells files "
    "from directories by the layout's marks (checked against the directory's link count), "
    "turns the names back into keys and sorts them once",
    ("s3", "put"): "the mailbox sends `If-None-Match: *` (the create-once condition, "
    "which moto checks) and the same CRC32 checksum as the baseline; nothing else in the "
    "request differs",
    ("s3", "get"): "a get adds only the key check and the concurrency limiter to the same "
    "`get_object`, nothing that grows with the object; no cause for a gap was found in the "
    "mailbox, which leaves moto (serving bodies from Python) and the shared machine, as the "
    "per-repetition column shows",
    ("s3", "list"): "the same `list_objects_v2` pages plus a `StartAfter` cut and "
    "prefix stripping per key; against moto's per-page time the difference is within "
    "the spread",
}


def _store_notes(
    misses: list[tuple[str, str, str, str, float, dict[str, Any] | None, bool]], target: float
) -> list[str]:
    lines = [f"Where a ratio is under the {target} target, by how much and why:", ""]
    for backend, name, op, size, value, spread, small in misses:
        cause = _STORE_CAUSES.get((name, op, "small" if small else "large")) or _STORE_CAUSES.get(
            (name, op), "cause not analysed"
        )
        noisy = spread is not None and spread["max"] >= target
        where = "list" if op == "list" else f"{op} {size}"
        lines.append(
            f"- {name} {where} on {backend}: {_num(value, 2)}, "
            f"{100 * (1 - value / target):.1f}% under; "
            + (
                f"single repetitions reached {_num(spread['max'], 2)}, so part of it is "
                "noise on a shared machine; "
                if noisy and spread is not None
                else ""
            )
            + cause
            + "."
        )
    return [*lines, ""]


def rounds(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 4. Round latency and scale", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/rounds.json` is missing._", "")
        return
    p, f = result["parameters"], result["figures"]
    page.add(_provenance(result), "")
    latency = f.get("latency")
    if latency:
        page.add(
            "**Round latency**: from the moment the put of a round's last snapshot returned "
            "to the moment a learner's listing first returned that round's record, on a "
            f"`{p['latency_store']}`, with {p['latency_learners']} learners that step in "
            f"lockstep, one fragment per round (F={p['latency_fragments']}, "
            f"{p['latency_encoding']} deltas and updates), each learner also a syncer, poll "
            f"interval {p['poll_interval']} s (up to that much of the latency is the poll). "
            "The latency spans the closing syncer's poll, reading and decoding the snapshots, "
            "the outer step, encoding and hashing θ, the outer state and the update, writing "
            "them and the record, and a learner's poll. The first round is shown apart: it "
            "also pays for the syncers' first loads of θ and the outer state.",
            "",
            *_table(
                ["fragment size", "rounds", "p50", "p90", "max", "first round"],
                [
                    [
                        f"{int(size):,} parameters",
                        str(entry["rounds"]),
                        f"{_num(entry['p50_s'] * 1e3, 0)} ms",
                        f"{_num(entry['p90_s'] * 1e3, 0)} ms",
                        f"{_num(entry['max_s'] * 1e3, 0)} ms",
                        f"{_num(entry['first_round_s'] * 1e3, 0)} ms",
                    ]
                    for size, entry in latency.items()
                ],
            ),
        )
    scale = f.get("scale")
    if scale:
        syncers = (
            f"the first {p['scale_syncers']} also syncers, the others learner-only"
            if p.get("scale_syncers")
            else "each also a syncer"
        )
        kinds = sorted({k for entry in scale["by_n"].values() for k in entry["per_round"]})
        page.add(
            f"**Scale**: N simulated learners in one process, each a full node "
            f"({syncers}), on a `MemoryMailbox` wrapped to count every request, "
            f"{p['scale_model']} ({p['scale_params']:,} parameters), F={p['scale_fragments']}, "
            f"H={p['scale_sync_every']}, poll interval "
            f"{p.get('scale_poll_interval', p['poll_interval'])} s; the learners step in "
            f"lockstep every {p['scale_tick_s'] * 1e3:.0f} ms for {p['scale_seconds']} s "
            f"after {p['scale_warmup_s']} s of warm-up; the requests of every node in that "
            "window are divided by the rounds whose record was first listed in it. Polls are "
            "paced by time, not by rounds, so requests per round compare across N only "
            "while the rounds keep the tick's pace (the `kept pace` column: at least 90% of "
            "the nominal rate); a process that cannot keep up closes fewer rounds while its "
            "nodes keep polling.",
            "",
            *_table(
                [
                    "N",
                    "rounds",
                    "rounds/s",
                    "requests/round",
                    *[f"{k}/round" for k in kinds],
                    "requests/round/learner",
                    "requests/s/learner",
                    "kept pace",
                ],
                [
                    [
                        n,
                        str(entry["rounds"]),
                        _num(entry["rounds_per_s"], 2),
                        _num(entry["requests_per_round"], 1),
                        *[_num(entry["per_round"].get(k, 0.0), 1) for k in kinds],
                        _num(entry["requests_per_round_per_learner"], 2),
                        _num(entry.get("requests_per_s_per_learner"), 1),
                        {True: "yes", False: "**no**", None: "–"}[entry.get("kept_pace")],
                    ]
                    for n, entry in scale["by_n"].items()
                ],
            ),
            f"Least-squares fit of requests per round against N: slope "
            f"**{_num(scale['fit']['slope'], 2)} requests per round per learner**, intercept "
            f"{_num(scale['fit']['intercept'], 1)}, R² {_num(scale['fit']['r2'], 4)}.",
            "",
        )

        def draw(figure: Any) -> None:
            axes = figure.add_subplot(1, 1, 1)
            ns = [int(n) for n in scale["by_n"]]
            ys = [entry["requests_per_round"] for entry in scale["by_n"].values()]
            axes.plot(ns, ys, "o", label="measured")
            fit = scale["fit"]
            axes.plot(ns, [fit["slope"] * n + fit["intercept"] for n in ns], "-", label="fit")
            axes.set_xlabel("learners N")
            axes.set_ylabel("store requests per round")
            axes.grid(True, alpha=0.3)
            axes.legend()
            axes.set_title("Requests per round against learners")

        page.plot("scale.png", draw, "requests per round against learners")


def events(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 5. Event bus", "")
    if result is None:
        page.add("_Not measured here: `benchmarks/results/events.json` is missing._", "")
        return
    page.add(
        _provenance(result),
        "",
        "Measured by `benchmarks/bench_events.py` (see its docstring); medians of "
        f"{result['parameters']['repetitions']} repetitions.",
        "",
    )
    backends = list(result["figures"])
    keys = list(result["figures"][backends[0]])
    page.add(
        *_table(
            ["figure", *backends],
            [
                [key, *[_num(result["figures"][b][key]["median"], 2) for b in backends]]
                for key in keys
            ],
        )
    )
    worst = max(result["figures"][b]["emit_us_loop_thread"]["median"] for b in backends)
    page.target(
        "event emit on the loop thread",
        f"< {result['target_emit_us']} µs",
        f"{_num(worst, 2)} µs",
        worst < result["target_emit_us"],
        "",
    )


# -- learner groups (benchmarks/bench_groups.py) ----------------------------------------


_GROUP_ROLE = {
    "group_leader": "DDP: leader",
    "group_follower": "DDP: follower",
    "fsdp_leader": "FSDP2: rank 0",
    "fsdp_follower": "FSDP2: rank 1",
    "single_leader": "single learner",
}


def _group_rows(f: dict[str, Any], roles: tuple[str, ...]) -> list[list[str]]:
    def row(label: str, key: str, show: Callable[[Any], str]) -> list[str]:
        shown = [show(f[r][key]) if f[r].get(key) is not None else "—" for r in roles]
        return [label, *shown]

    return [
        row("`step()` on the caller, p50", "step_ms_p50", lambda v: f"{_num(v, 2)} ms"),
        row("`step()` on the caller, mean", "step_ms_mean", lambda v: f"{_num(v, 2)} ms"),
        row("`step()` on the caller, p99", "step_ms_p99", lambda v: f"{_num(v, 2)} ms"),
        row("store bytes written", "store_up", _bytes),
        row("store bytes read", "store_down", _bytes),
        row("group collectives, bytes sent", "group_sent", _bytes),
        row("group collectives, bytes received", "group_received", _bytes),
        row("publishing one fragment (median)", "publish_s_median", lambda v: f"{_num(v, 4)} s"),
        row("peak resident memory", "peak_rss_bytes", _bytes),
        row("parameters held", "param_bytes", _bytes),
        row("snapshot bytes uploaded (from the store)", "snapshot_up", _bytes),
        row("bytes of one snapshot (its part, from the store)", "snapshot_bytes", _bytes),
    ]


def _sharded(f: dict[str, Any]) -> list[str]:
    """The FSDP2 arm's sentences, when the results have it."""
    if "fsdp_leader" not in f:
        return []
    return [
        "In the *fsdp* arm each learner's parameters are cut in two by `fully_shard` (a CPU "
        "mesh): every rank runs the learner over its own rows, uploads its rows of each "
        "snapshot as a part and reads its rows of every version by byte ranges. Each rank "
        f"held {_num(f['fsdp_leader_param_ratio'], 2)}× a single learner's parameter bytes "
        f"and uploaded {_num(f['fsdp_leader_snapshot_up_ratio'], 3)}× (rank 0) and "
        f"{_num(f['fsdp_follower_snapshot_up_ratio'], 3)}× (rank 1) the bytes of a single "
        "learner's snapshot, for each of its snapshots; rank 1 read "
        f"{_num(f['fsdp_follower_store_down_ratio'], 2)}× what a single learner read (its rows "
        "of every version, their chunk indexes and blob headers; rank 0 also reads as the "
        "learner's syncer). A sharded `step()` (a tick: one all-reduce, plus the leader's "
        "log and the ranks' part reports when there are any) cost "
        f"{_num(f['fsdp_step_ms_added_p50'], 2)} ms more than a single learner's at the "
        "median; publishing one fragment took "
        f"{_num(f['fsdp_leader']['publish_s_median'], 4)} s on the leader (its own part "
        "encoded and uploaded, then the other rank's report, which travels at its next "
        "`step()`, then the snapshot written). The final loss ratio (fsdp ÷ single) is "
        f"{_num(f['fsdp_loss_ratio'], 3)}.",
        "",
    ]


def groups(page: Page, result: dict[str, Any] | None) -> None:
    """Learner groups: a 2-rank DDP learner (and, when measured, a 2-rank FSDP2 learner)
    against a 1-process learner of the same batch."""
    page.add("## 9. Learner groups", "")
    if result is None:
        page.add(
            "_Not measured: `benchmarks/results/groups.json` is missing "
            "(`benchmarks/bench_groups.py`)._",
            "",
        )
        return
    p, f = result["parameters"], result["figures"]
    arms = ["group", "fsdp", "single"] if "fsdp_leader" in f else ["group", "single"]
    roles = tuple(r for r in _GROUP_ROLE if r.split("_")[0] in arms)
    page.add(
        _provenance(result),
        "",
        f"Two learners train the demo's model ({p['model']}, context {p['context']}) on its "
        f"synthetic language for {p['steps']} steps of a {p['learner_batch']}-sequence "
        f"batch each (F={p['fragments']}, H={p['sync_every']}, `LocalMailbox`, each "
        "learner also a syncer): in the *group* arm each learner is 2 processes (DDP over "
        "gloo, CPU) taking half of the batch each"
        + (
            ", in the *fsdp* arm 2 processes whose parameters FSDP2 shards, taking half of "
            "the batch each"
            if "fsdp" in arms
            else ""
        )
        + ", in the *single* arm one process taking all of it, from the same stream. "
        f"{p['repetitions']} run(s) of each arm, in turn; per-rank figures are medians "
        "over the runs and learners (per rank: a DDP group's leader is rank 0, which alone "
        "talks to the store; its follower receives the fragments that change by broadcast).",
        "",
        *_table(
            [
                "figure",
                *[_GROUP_ROLE[role] for role in roles],
            ],
            _group_rows(f, roles),
        ),
        *_table(
            ["figure", *arms],
            [
                [
                    "final evaluation loss (nats), median of learners and runs",
                    *[_spread(f[f"{arm}_eval_loss"], 3) for arm in arms],
                ],
                ["rounds committed", *[_num(f[f"{arm}_rounds"], 1) for arm in arms]],
                [
                    "wall time of a run",
                    *[f"{_num(f[f'{arm}_seconds']['median'], 1)} s" for arm in arms],
                ],
            ],
        ),
        f"A group's `step()` costs {_num(f['step_ms_added_p50'], 2)} ms more than a single "
        "learner's at the median: one all-reduce of a few ints (the leader's decision) "
        "between two processes and the hop into a worker thread, plus, once per round, the "
        "broadcast of the fragment the round changed. The leader's store traffic is "
        f"{_num(f['leader_store_up_ratio'], 3)}× the single learner's (written bytes): a "
        "group is one learner to the run. The final loss ratio (group ÷ single) is "
        f"{_num(f['loss_ratio'], 3)}: the arms see the same data and the same mean "
        "gradients, so what differs is the order of float sums and the timing of rounds.",
        "",
        *_sharded(f),
    )


# -- real text (benchmarks/bench_text.py) -----------------------------------------------


def _text_order(arm: str) -> tuple[int, int, str, int]:
    if arm in ("dp", "single"):
        return (0, 0 if arm == "dp" else 1, "", 0)
    parts = arm.split("-")
    system = {"gm": 1, "torchft": 2}[parts[0]]
    return (
        len(parts) - 2,
        system,
        {"fp32": "a", "int8": "b", "int4": "c"}.get(parts[1], parts[1]),
        int(parts[2][1:]),
    )


def _text_label(arm: str) -> str:
    label = _ARM_LABEL.get(arm, arm)
    return label.replace("-kill", " (one learner killed)")


TEXT_SIZES = ("full", "medium", "small")
"""The real-text sizes the page shows, each from its own result file when it exists."""


def _text_results(results: Path) -> dict[str, Any] | None:
    """Each real-text size's result (``text.json`` for the full size, ``text-{size}.json``
    for the others), with its fp32 pairs in both orders under ``timing``
    (``text-timing-{size}.json``, None when not measured), or None when there is none."""
    found = {}
    for size in TEXT_SIZES:
        result = _load(results, "text" if size == "full" else f"text-{size}")
        fair = _load(results, f"text-fair-{size}")
        if result is not None or fair is not None:
            found[size] = (result or {}) | {
                "timing": _load(results, f"text-timing-{size}"),
                "fair": fair,
            }
    return found or None


def text(page: Page, by_size: dict[str, Any] | None) -> None:
    """The real-text task at every size measured."""
    page.add("## 6. Real text: the standard library, against torchft's DiLoCo", "")
    if by_size is None:
        page.add(
            "_Not measured: `benchmarks/results/text.json` is missing (`nox -s bench-text`)._",
            "",
        )
        return
    if "full" not in by_size:
        page.add(
            "_The full size (a 1M-parameter GPT, 1,000 steps, every arm) is not measured: "
            "`nox -s bench-text` runs it. A full-size step costs about 22 medium ones (one "
            "learner alone: 126 s against 5.6 s for 1,000 steps on an idle core), so on two "
            "idle cores the headline arms (data-parallel, single, gradientmail and torchft "
            "at fp32 H=100) take 22 minutes and every arm about an hour and a half._",
            "",
        )
        page.target(
            "real text (full size): every arm, the torchft ratios and the failure side by side",
            "measured",
            "not run (sizes small and medium only)",
            None,
            "nox -s bench-text; see section 6",
        )
    else:
        p = by_size["full"]["parameters"]
        every = bench_text.arms(p)  # the size's settings are in its parameters
        left = [arm for arm in every if arm not in p["arms"]]
        page.target(
            "real text (full size): every arm, the torchft ratios and the failure side by side",
            "measured",
            f"{len(every) - len(left)} of {len(every)} arms"
            + (f"; not run: {', '.join(left)}" if left else ""),
            not left,
            "nox -s bench-text; see section 6",
        )
    for size, result in by_size.items():
        page.add(f"### Size `{size}`", "")
        if result.get("fair") is not None:
            report_fair.section(page, result["fair"])
        if "parameters" in result:
            _text_size(page, result)


def _pacing(overlap: int | None) -> str:
    return "unpaced" if overlap is None else f"overlap {overlap}"


def _invocations(result: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    """The invocations that measured ``result``'s arms (``bench_text.py --keep``), oldest
    first, each with its arms; a run without ``measured`` is the file's header's."""
    header = bench_text.invocation(result)
    found: list[tuple[dict[str, Any], list[str]]] = []
    for arm in sorted(result["figures"]["arms"], key=_text_order):
        measured = result["figures"]["arms"][arm].get("measured", header)
        for seen, names in found:
            if seen == measured:
                names.append(arm)
                break
        else:
            found.append((measured, [arm]))
    return sorted(found, key=lambda item: str(item[0]["date"]))


def _gm_pacing(result: dict[str, Any]) -> str:
    """What the page says of the gradientmail arms' pacing: one sentence when every
    invocation ran them alike, else a pointer to the invocations' list."""
    overlaps = {
        measured["overlap"]
        for measured, names in _invocations(result)
        if any(name.startswith("gm-") for name in names)
    }
    if len(overlaps) > 1:
        return (
            "gradientmail's learners ran unpaced in some invocations and paced in others "
            "(`RunConfig.overlap`: listed under the table). "
        )
    overlap = next(iter(overlaps), None)
    if overlap is None:
        return (
            "gradientmail's learners are unpaced (`RunConfig.overlap` None): each applies "
            "a round's version at the first step after it is ready. "
        )
    return (
        f"gradientmail's learners apply each round's version {overlap} steps after "
        "their snapshot, waiting for it there if need be (`RunConfig.overlap`). "
    )


def _text_produced(result: dict[str, Any]) -> list[str]:
    """How the size's arms were produced: one invocation, or each of the invocations whose
    runs the file kept."""
    p, figures = result["parameters"], result["figures"]
    invocations = _invocations(result)
    if len(invocations) == 1:
        return [
            f"Produced by `benchmarks/bench_text.py --size {p['size']} --only "
            f"{' '.join(p['arms'])}` in {figures['total_seconds'] / 60:.1f} minutes (`nox -s "
            "bench-text` runs every arm at the full size).",
            "",
        ]
    lines = [
        f"Measured in {len(invocations)} invocations of `benchmarks/bench_text.py --size "
        f"{p['size']} --keep --only ...` (each kept the runs of the others; gradientmail ÷ "
        "torchft time ratios only for a pair measured in one invocation, the losses being "
        "the same on any machine):",
        "",
    ]
    for measured, names in invocations:
        lines.append(
            f"- {measured['date']}, commit `{str(measured['git_commit'])[:12]}`, gradientmail "
            f"{_pacing(measured['overlap'])}: {', '.join(names)}"
        )
    return [*lines, ""]


def _text_size(page: Page, result: dict[str, Any]) -> None:
    """One size: every arm, gradientmail ÷ torchft, the failure and the ordering."""
    p, figures = result["parameters"], result["figures"]
    table, arms = figures["table"], figures["arms"]
    size = p["size"]
    scale = (
        ""
        if size == "full"
        else f" **Size `{size}`: a scaled-down run (the full size is 1,000 steps of a "
        "1M-parameter model), so its figures check the harness and the orderings, not the "
        "full-size losses.**"
    )
    model = p["model"]
    pacing = p.get("pacing", {"poll_interval": p.get("poll_interval", 0.05)})
    if not report_fair.fair(result):
        page.add(*report_fair.earlier(size))
    page.add(
        _provenance(result),
        "",
        f"A byte-level GPT (d_model {model['d_model']}, {model['n_layers']} layers, "
        f"{model['n_heads']} heads, context {model['context']}; {p['params']:,} parameters) "
        f"learns the Python standard library's own source ({p['corpus']}); a file is held out "
        "for validation by a hash of its path. "
        f"{p['learners']} learners, {p['steps']} steps each, batch {p['batch']} windows, AdamW "
        f"at {p['lr']} with warm-up and cosine decay; {p['fragments']} fragments "
        f"(`{p['pattern']}`) in both systems, outer Nesterov SGD "
        f"{p.get('outer_lr', 0.7)} / {p.get('outer_momentum', 0.9)} in both. "
        + _gm_pacing(result)
        + "Data-parallel trains one model on the union of the learners' batches. "
        "gradientmail runs the learners and a dedicated syncer as processes on a directory; "
        "torchft runs each learner as its own replica group with `torchft.local_sgd.DiLoCo`, "
        "its lighthouse process and gloo on 127.0.0.1. Bytes per learner: gradientmail's "
        "**measured** (what each learner wrote and read), "
        + (
            "torchft's all-reduce payload **measured** (by wrapping its process group) and "
            "sent and received by a ring, 2 × 2(p − 1)/p × its bytes for p participants, "
            "data-parallel's **computed** (ring all-reduce of fp32, sent: 2(K − 1)/K × 4 "
            "bytes × elements per gradient step). "
            if report_fair.fair(result)
            else "data-parallel's and torchft's **computed** (ring all-reduce of fp32, sent "
            "only: 2(p − 1)/p × 4 bytes × elements, per gradient step for data-parallel, per "
            "fragment sync and its participants p for torchft). "
        )
        + "Wall time is the arm's, process start to the last exit, on this shared "
        "machine; train time the learners' mean from first to last step; CPU the user and "
        "system time of every process of the arm (gradientmail's learners and syncer, "
        "torchft's learners, not its lighthouse process). gradientmail's nodes poll "
        f"every {pacing['poll_interval']} s and beat their lease every "
        f"{pacing.get('lease_every', 0.5)} s (gone after {pacing.get('lease_timeout', 5.0)} "
        "s)"
        + (
            f", and poll every {pacing['due_poll_interval']} s while a round is due"
            if "due_poll_interval" in pacing
            else ""
        )
        + "."
        + (
            " The lag in the last column is the local steps between a learner's snapshot and "
            "its applying that round (median and maximum over every learner's rounds)."
            if any(run.get("lag_steps_median") is not None for run in arms.values())
            else ""
        )
        + scale,
        "",
        *_text_produced(result),
    )
    rows = []
    dp_bytes = table.get("dp", {}).get("bytes_per_learner")
    for arm in sorted(table, key=_text_order):
        entry, run = table[arm], arms[arm]
        lag = (
            f", lag {run['lag_steps_median']:g} steps (max {run['lag_steps_max']})"
            if run.get("lag_steps_median") is not None
            else ""
        )
        sync = (
            f"{run['rounds_committed']} rounds, {run['mean_participants']:.2f} per round{lag}"
            if "rounds_committed" in run
            else f"{sum(run['syncs'])} syncs, {sum(run['failed_syncs'])} failed"
            if "syncs" in run
            else "–"
        )
        rows.append(
            [
                _text_label(arm),
                _num(entry["bits_per_byte"], 4),
                _num(entry.get("excess_over_dp"), 4),
                {True: "yes", False: "**no**", None: "–"}[entry.get("beats_single")],
                _num(entry["wall_seconds"], 0),
                _num(entry["train_seconds"], 1),
                _bytes(entry["bytes_per_learner"]) if entry["bytes_per_learner"] else "–",
                _num(dp_bytes / entry["bytes_per_learner"], 0)
                if dp_bytes and entry["bytes_per_learner"] and arm.startswith("gm-")
                else "–",
                _num(run["peak_store_bytes"] / (4 * p["params"]), 2)
                if run.get("peak_store_bytes") and p.get("params")
                else "–",
                sync,
            ]
        )
    page.add(
        *_table(
            [
                "arm",
                "validation bits/byte",
                "excess over DP",
                "beats single",
                "wall (s)",
                "train (s)",
                "bytes per learner",
                "DP bytes ÷ these",
                "peak storage ÷ fp32 model",
                "rounds / syncs",
            ],
            rows,
        )
    )
    _text_versus(page, result)
    if result.get("timing") is not None:
        _text_timing(page, result["timing"])
    _text_failure(page, figures["failure"], arms, p)
    _text_plot(page, arms, size)


def _timing_pairs(result: dict[str, Any]) -> dict[str, Any]:
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
        == _timing_overlap(timing, pair)
    }


def _timing_overlap(timing: dict[str, Any], pair: dict[str, Any]) -> int | None:
    """The ``RunConfig.overlap`` of a pair's gradientmail runs: its invocation's (a pair
    without ``measured`` is the file header's; a header without ``overlap`` is older than
    the paced default: unpaced)."""
    return pair.get("measured", {"overlap": timing["parameters"].get("overlap")})["overlap"]


def _text_versus(page: Page, result: dict[str, Any]) -> None:
    """gradientmail ÷ torchft at each H; the wall target is judged on the pairs run in both
    orders (``_timing_pairs``) where they were measured, else on the matrix's pair (and
    not at all for a pair whose arms two invocations measured)."""
    versus, size = result["figures"]["versus_torchft"], result["parameters"]["size"]
    if not versus:
        return
    pairs = _timing_pairs(result)
    page.add(
        "gradientmail ÷ torchft, fp32, the same H, each pair measured in one invocation (–: not):",
        "",
    )
    rows = []
    for sync_every, v in sorted(versus.items(), key=lambda item: int(item[0])):
        gm_excess, ft_excess = v["excess_over_dp"]
        rows.append(
            [
                sync_every,
                _num(v["bits_per_byte_ratio"], 4),
                f"{_num(gm_excess, 4)} vs {_num(ft_excess, 4)}",
                _num(v["wall_ratio"], 2),
                _num(v["train_ratio"], 2),
                _num(v.get("cpu_ratio"), 2),
                _num(v["bytes_ratio"], 2),
            ]
        )
        judged = report_fair.fair(result)
        met = None if gm_excess is None or ft_excess is None else gm_excess <= ft_excess
        page.target(
            f"real text ({size}) H={sync_every}: excess over DP, gradientmail vs torchft",
            "≤ torchft's",
            f"{_num(gm_excess, 4)} vs {_num(ft_excess, 4)} bits/byte",
            met if judged else report_fair.NOT_JUDGED,
            "bench_text",
        )
        both = pairs.get(sync_every, {}).get("wall_ratio")
        wall = v["wall_ratio"] if both is None else both
        own = (
            _num(v["wall_ratio"], 2)
            if v["wall_ratio"] is not None
            else "not measured: its arms come from two invocations"
        )
        page.target(
            f"real text ({size}) H={sync_every}: wall time ÷ torchft's",
            "≤ 1.0",
            own
            if both is None
            else f"{_num(both, 3)} (each pair in both orders; the matrix's own pair {own})",
            (None if wall is None else wall <= 1.0) if judged else report_fair.NOT_JUDGED,
            "bench_text" if both is None else "bench_text --mode timing",
        )
    page.add(
        *_table(
            [
                "H",
                "bits/byte ratio",
                "excess over DP (gm vs torchft)",
                "wall ratio",
                "train ratio",
                "CPU ratio",
                "bytes ratio",
            ],
            rows,
        )
    )


def _text_timing(page: Page, timing: dict[str, Any]) -> None:
    """The fp32 pairs run in both orders (``bench_text_timing``)."""
    p = timing["parameters"]
    rows = []
    for sync_every, pair in sorted(timing["figures"]["pairs"].items(), key=lambda i: int(i[0])):
        walls = {
            system: ", ".join(_num(run["wall_seconds"], 0) for run in pair[system])
            for system in ("gm", "torchft")
        }
        measured = pair.get("measured", bench_text.invocation(timing))
        rows.append(
            [
                sync_every,
                _pacing(_timing_overlap(timing, pair)),
                f"{measured['date'][:10]}, `{measured['git_commit'][:7]}`",
                walls["gm"],
                walls["torchft"],
                _num(pair.get("wall_ratio"), 3),
                _num(pair.get("wall_ratio_gm_first"), 3),
                _num(pair.get("wall_ratio_torchft_first"), 3),
                _num(pair.get("train_ratio"), 3),
                _num(pair.get("cpu_ratio"), 3),
            ]
        )
    page.add(
        "Wall time with each fp32 pair run in both orders ("
        + ", ".join(p["order"])
        + "), so that this machine's drift weighs on both systems alike; the ratio is both "
        "gradientmail runs' time over both torchft runs'. "
        + _provenance(timing)
        + f" Produced by `benchmarks/bench_text.py --size {p['size']} --mode timing`.",
        "",
        *_table(
            [
                "H",
                "gradientmail",
                "measured",
                "gradientmail wall (s)",
                "torchft wall (s)",
                "wall ratio",
                "gm first",
                "torchft first",
                "train ratio",
                "CPU ratio",
            ],
            rows,
        ),
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


def _text_failure(
    page: Page, failure: dict[str, Any], arms: dict[str, Any], p: dict[str, Any]
) -> None:
    if not failure:
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
    for arm in sorted(failure, key=_text_order):
        f = failure[arm]
        lost, lost_text = _lost(arms[arm])
        rows.append(
            [
                arm,
                str(f["killed_at_step"]),
                _num(f["survivors_longest_pause"], 2),
                _num(f["survivors_seconds_beyond_median"], 2),
                lost_text,
                _num(f["restarted_first_step_seconds"], 1),
                _num(f["restarted_on_group_model_seconds"], 1),
                _num(f["bits_per_byte"], 4),
            ]
        )
        page.target(
            f"real text ({p['size']}), {arm.split('-')[0]}: survivors' work discarded after a kill",
            "none",
            f"{lost_text}; longest pause {_num(f['survivors_longest_pause'], 2)} s",
            lost == 0,
            "bench_text",
        )
    page.add(
        *_table(
            [
                "arm",
                "killed at step",
                "survivors' longest pause (s)",
                "survivors' time beyond median (s)",
                "survivors' lost work",
                "restart → first step (s)",
                "restart → on the group's model (s)",
                "final bits/byte",
            ],
            rows,
        )
    )


def _text_plot(page: Page, arms: dict[str, Any], size: str) -> None:
    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        for arm in sorted(arms, key=_text_order):
            if arm.endswith("-kill") or (arm.startswith("gm-") and arm.split("-")[1] != "fp32"):
                continue
            curve = arms[arm]["curve"]
            style = {"dp": "k-", "single": "k:"}.get(arm, "--" if "torchft" in arm else "-")
            axes.plot(
                [x for x, _ in curve],
                [y / math.log(2) for _, y in curve],
                style,
                label=_text_label(arm),
                linewidth=1.2,
            )
        axes.set_xlabel("steps per learner")
        axes.set_ylabel("validation bits per byte")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
        axes.set_title(f"Real text, size {size}: validation loss against steps (fp32)")

    page.plot(f"text-{size}.png", draw, f"validation bits per byte against steps, size {size}")


_GRID_KEY = ("outer_lr", "outer_momentum", "sync_every", "quorum_fraction", "grace", "pattern")


def _grid_defaults() -> dict[str, Any]:
    """``RunConfig``'s defaults for the grid's settings, as the code stands."""
    from gradientmail.protocol.records import RunConfig

    defaults = RunConfig()
    return {key: getattr(defaults, key) for key in _GRID_KEY}


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
        _provenance(result),
        "",
        f"One gradientmail run per point (section 1's task and learners, {p['steps']} steps, "
        f"seed {p['seed']}, {p['encoding']}), best first by excess over the entropy floor ÷ "
        f"data-parallel's ({_num(references['dp']['excess'], 4)}); a single learner's excess "
        f"is {_num(references['single']['excess'], 4)}. One seed: a difference of a few "
        "percent between neighbours is within noise. Quorum / grace: a round closes once it "
        "has that fraction of the live learners, then waits up to grace for the rest.",
        "",
        "The best point for each value of each setting (the other settings free):",
        "",
    )
    rows = []
    for key in _GRID_KEY:
        for value in sorted({point[key] for point in points}):
            best = min(
                (point for point in points if point[key] == value),
                key=lambda point: point["excess_ratio_vs_dp"],
            )
            marker = " (default)" if defaults[key] == value else ""
            rows.append([key, f"{value}{marker}", _num(best["excess_ratio_vs_dp"], 3)])
    page.add(*_table(["setting", "value", "best excess ÷ DP's"], rows))
    chosen = next(
        (point for point in points if all(point[k] == defaults[k] for k in _GRID_KEY)), None
    )
    best = points[0]
    if chosen is not None:
        page.target(
            "defaults grid: RunConfig's defaults against the grid's best point",
            "within 10% of the best",
            f"{_num(chosen['excess_ratio_vs_dp'], 3)} vs {_num(best['excess_ratio_vs_dp'], 3)} "
            "(excess ÷ DP's)",
            chosen["excess_ratio_vs_dp"] <= 1.1 * best["excess_ratio_vs_dp"],
            "bench_convergence --grid (one seed)",
        )
    page.add("<details><summary>Every point</summary>", "")
    rows = [
        [
            _num(point["outer_lr"], 2),
            _num(point["outer_momentum"], 2),
            str(point["sync_every"]),
            f"{_num(point['quorum_fraction'], 2)} / {_num(point['grace'], 1)} s",
            point.get("pattern", "contiguous"),
            _num(point["excess"], 4),
            _num(point["excess_ratio_vs_dp"], 3),
            _num(point["mean_participants"], 2),
            "**default**" if point is chosen else "",
        ]
        for point in points
    ]
    page.add(
        *_table(
            [
                "outer lr",
                "outer momentum",
                "H",
                "quorum / grace",
                "pattern",
                "excess",
                "excess ÷ DP's",
                "snapshots per round",
                "",
            ],
            rows,
        ),
        "</details>",
        "",
    )


TEXT_SEED_MODES = {
    "defaults": "### The defaults on real text, three seeds",
    "repeat": "### Repeatability: the defaults, two learners, plain SGD, five seeds",
    "rerun": "### Repeatability: the same run five times (only the timing differs)",
}


def _text_seed_results(results: Path) -> dict[str, Any] | None:
    """``bench_text --mode defaults|repeat|rerun``'s results, the largest size measured of each
    (``quick`` last: the smoke-test size)."""
    found = {}
    for mode in TEXT_SEED_MODES:
        for size in (*TEXT_SIZES, "quick"):
            result = _load(results, f"text-{mode}-{size}")
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
        _text_seed_mode(page, result)


def _row_order(label: str) -> tuple[int, int]:
    """A row of a seeds mode in order: its seed, then its rerun (``seed#run``)."""
    seed, _, rerun = label.partition("#")
    return int(seed), int(rerun or 0)


def _text_seed_mode(page: Page, result: dict[str, Any]) -> None:
    p, figures = result["parameters"], result["figures"]
    per_seed, over, arms = figures["per_seed"], figures["over_seeds"], figures["arms"]
    configs = {
        arm: run["config"] for seed in arms.values() for arm, run in seed.items() if "config" in run
    }
    inner = (
        f"plain SGD at {p['inner_lr']} (gradient norm clipped to {p['sgd_clip']})"
        if p["inner"] == "sgd"
        else f"AdamW at {p['inner_lr']}"
    )
    model = p["model"]
    page.add(
        _provenance(result),
        "",
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
        + ".",
        "",
    )
    arm_names = sorted(over, key=lambda arm: ({"dp": 0, "single": 1}.get(arm, 2), arm))
    rows = []
    for seed, row in sorted(per_seed.items(), key=lambda item: _row_order(item[0])):
        cells = [seed]
        for arm in arm_names:
            entry = row.get(arm)
            if entry is None:
                cells.append("–")
                continue
            text = _num(entry["bits_per_byte"], 4)
            if arm.startswith("gm-") and "excess_over_dp" in entry:
                text += f" ({entry['excess_over_dp']:+.4f}"
                if "beats_single" in entry:
                    text += ", beats single" if entry["beats_single"] else ", **not below single**"
                text += f"; {entry['rounds_without_all']}/{entry['rounds_committed']} rounds short)"
            cells.append(text)
        rows.append(cells)
    page.add(
        "Validation bits per byte per row (gradientmail: its excess over data-parallel of the "
        "same seed, and the rounds that closed without every learner):",
        "",
        *_table(["seed", *arm_names], rows),
    )
    rows = []
    for arm in arm_names:
        entry = over[arm]
        excess = entry.get("excess_over_dp")
        rows.append(
            [
                arm,
                _spread(entry["bits_per_byte"], 4),
                _num(entry.get("bits_per_byte_spread"), 3),
                _spread(excess, 4) if excess else "–",
                _num(entry.get("excess_spread"), 2),
                f"{entry['beats_single']} of {entry['runs']}" if "runs" in entry else "–",
            ]
        )
    page.add(
        "Over the rows (median [min, max]; max/min excess: of the excesses' magnitudes when "
        "they share a sign, – when they straddle zero):",
        "",
        *_table(
            [
                "arm",
                "bits/byte",
                "max/min bits/byte",
                "excess over DP",
                "max/min excess",
                "runs below single",
            ],
            rows,
        ),
    )
    single = over.get("single", {}).get("excess_spread")
    paced = _paced_arms(over, configs)
    unpaced = [arm for arm in arm_names if arm.startswith("gm-") and arm not in paced]
    if p.get("reruns") and unpaced:
        local = ", ".join(
            f"{arm}'s {_num(over[arm]['bits_per_byte_spread'], 3)}"
            for arm in ("dp", "single")
            if arm in over
        )
        page.add(
            f"The local arms' max/min over the reruns ({local}) is this machine's own "
            "nondeterminism; what spreads an unpaced gradientmail's rows is the timing of its "
            "processes alone: standard deviation "
            + ", ".join(
                f"{_num(over[arm]['bits_per_byte']['stdev'], 4)} bits/byte (`{arm}`)"
                for arm in unpaced
            )
            + ".",
            "",
        )
        _paced(page, per_seed, over, paced, unpaced[0])
    elif single is not None:
        page.add(
            f"The single learner's own max/min excess over data-parallel, {_num(single, 2)}, "
            "is the seed-to-seed noise of this measure without gradientmail in the loop: a "
            "spread near it is the task's, not the protocol's.",
            "",
        )
    _text_seed_targets(page, p, over, paced)


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
        f"{_num(over[arm]['bits_per_byte_spread'], 3)} (standard deviation "
        f"{_num(over[arm]['bits_per_byte']['stdev'], 4)}), median wall "
        f"{_num(wall(arm) / wall(unpaced), 2)}× `{unpaced}`'s"
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


def _text_seed_targets(
    page: Page, p: dict[str, Any], over: dict[str, Any], paced: dict[str, int]
) -> None:
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
        over_what = "reruns of one seed" if p.get("reruns") else "seeds"
        spread, excess = defaults.get("excess_spread"), defaults["excess_over_dp"]
        measured = (
            _num(spread, 2)
            if spread is not None
            else f"undefined: excess {_num(excess['min'], 4)} to {_num(excess['max'], 4)} "
            "bits/byte (straddles DP's loss)"
        )
        page.target(
            f"{where}: spread of the excess over DP, max/min over {over_what}",
            f"≤ {p['spread_max']}",
            measured,
            spread is not None and spread <= p["spread_max"],
            "bench_text --mode " + p["mode"],
        )
        page.target(
            f"{where}: spread of the final loss, max/min over {over_what}",
            f"≤ {p['spread_max']}",
            f"{_num(defaults['bits_per_byte_spread'], 3)} (DP's "
            f"{_num(over['dp']['bits_per_byte_spread'], 3)})",
            defaults["bits_per_byte_spread"] <= p["spread_max"],
            "bench_text --mode " + p["mode"],
        )
        for arm, overlap in paced.items():
            if arm == "gm-defaults":
                continue
            paced = over[arm].get("excess_spread")
            page.target(
                f"{where}: with overlap {overlap}, spread of the excess over DP, "
                f"max/min over {over_what}",
                f"≤ {p['spread_max']}",
                _num(paced, 2) if paced is not None else "undefined (straddles DP's loss)",
                paced is not None and paced <= p["spread_max"],
                "bench_text --mode " + p["mode"],
            )
    previous = over.get("gm-previous")
    if previous is not None and "excess_over_dp" in previous:
        ours, theirs = (
            defaults["excess_over_dp"]["median"],
            previous["excess_over_dp"]["median"],
        )
        page.target(
            f"{where}: new defaults' excess over DP against the previous defaults'",
            "≤ the previous (median over seeds)",
            f"{_num(ours, 4)} vs {_num(theirs, 4)} bits/byte",
            ours <= theirs,
            "bench_text --mode defaults",
        )


BYTES_TARGET = 75.0
"""Issue 15: data-parallel's bytes ÷ gradientmail's with the syncer's share, int8, H = 50."""


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
        _provenance(result),
        "",
        f"The convergence benchmark's model ({p['params']:,} parameters) and {p['learners']} "
        f"learners at {p['encoding']}, H = {p['sync_every']}, {p['fragments']} fragments, run "
        f"for {p['steps']} steps (seed {p['seed']}): long enough that the closing flush (its "
        "final rounds) is a small share of a learner's bytes, given in the table. "
        "Data-parallel's bytes per learner are computed as in section 1 "
        f"({_bytes(figures['dp_bytes_per_learner'])}). The syncer's bytes are everything its "
        "process wrote and read; shared among the learners they make the last ratio.",
        "",
    )
    rows = []
    for every, run in sorted(figures["runs"].items(), key=lambda item: int(item[0])):
        rows.append(
            [
                every,
                str(run["rounds_committed"]),
                _bytes(run["bytes_per_learner"]),
                _num(100 * run["closing_bytes_per_learner"] / run["bytes_per_learner"], 1),
                _bytes(run["syncer_up"]),
                _bytes(run["syncer_down"]),
                _num(run["ratio_per_learner"], 0),
                _num(run["ratio_with_syncer_share"], 0),
            ]
        )
    page.add(
        *_table(
            [
                "checkpoint_every",
                "rounds",
                "bytes per learner",
                "closing flush %",
                "syncer up",
                "syncer down",
                "DP ÷ learner",
                "DP ÷ (learner + syncer ÷ K)",
            ],
            rows,
        )
    )
    from gradientmail.protocol.records import RunConfig

    default = str(p.get("default_checkpoint_every", RunConfig().checkpoint_every))
    if default not in figures["runs"]:
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
        f"{_bytes(run['bytes_per_learner'] / rounds)} and the syncer "
        f"{_bytes(syncer / rounds)} ({_bytes(run['syncer_up'] / rounds)} up: the update and "
        f"1/{default} of a checkpoint; the rest down: the learners' deltas and the metadata "
        "of the round). Without the learners' closing flush (their bytes after their last "
        f"training step, {_num(closing, 1)} % of them; the syncer's share of the closing "
        "rounds is not separated), data-parallel's "
        f"bytes ÷ gradientmail's with the syncer's share is {steady:.0f}×.",
        "",
    )
    page.target(
        f"DP bytes ÷ gradientmail's with the syncer's share (int8, H = 50, "
        f"checkpoint_every {default})",
        f"≥ {BYTES_TARGET:.0f}×",
        f"{ratio:.0f}×",
        ratio >= BYTES_TARGET,
        "Bytes over a long run",
    )


def rejoin(page: Page, result: dict[str, Any] | None) -> None:
    """A new learner's join time against the raw read (``bench_rejoin.py``)."""
    page.add("## 13. Rejoin", "")
    if result is None:
        page.add(
            "_Not measured: `benchmarks/results/rejoin{-large,}.json` are missing "
            "(`nox -s bench-large`)._",
            "",
        )
        return
    p, figures = result["parameters"], result["figures"]
    page.add(
        _provenance(result),
        "",
        f"A run of {p['params']:,} parameters ({p['mib']} MiB in fp32), {p['fragments']} "
        f"fragments at version {p['version']}, int8 updates, written into the store as "
        "garbage collection leaves it; a fresh learner joins (opening the node until it holds "
        "the newest θ of every fragment, `RunReader.rebuild`: the checkpoint at or below "
        "each version and the updates after it), against reading the same blobs raw with "
        f"the same mailbox. Median of {p['repetitions']} (min, max).",
        "",
    )
    rows = []
    for store_name, by_every in figures.items():
        for every, entry in sorted(by_every.items(), key=lambda item: int(item[0])):
            rows.append(
                [
                    store_name,
                    every,
                    _bytes(entry["bytes_read"]),
                    _spread(entry["join_seconds"], 2),
                    _spread(entry["raw_seconds"], 2),
                    _spread(entry["join_over_raw"], 2),
                ]
            )
    page.add(
        *_table(
            ["store", "checkpoint_every", "bytes read", "join s", "raw read s", "join ÷ raw"],
            rows,
        )
    )
    page.add(
        "The join does more than read: the node starts (manifest, model signature, lease), "
        "every blob is checked against its sha256, decoded and, after the checkpoint, each "
        "update applied in a worker thread, two fragments at a time; the raw baseline reads "
        "the blobs one after another and does nothing with them. A directory's raw read "
        "comes from the page cache, so there the ratio is the join's own work. With the default "
        "`checkpoint_every` a joiner at version 21 reads the checkpoint at 16 and five "
        "updates (int8: a quarter of θ's bytes each): on average over where a join lands "
        "3.5 updates, at worst 7.",
        "",
    )


def _binary(value: float) -> str:
    """A size in GiB or MiB (transfer sizes are powers of two)."""
    if value >= 2**30:
        return f"{value / 2**30:g} GiB"
    return f"{value / 2**20:g} MiB"


def transfer(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 11. Large transfers", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/transfer.json` is missing._", "")
        page.target("large transfers ÷ raw client", "≥ 0.9", "–", None, "not run")
        return
    p, f = result["parameters"], result["figures"]
    s3 = next(iter(f.values()))["s3"]
    warm = ", after one untimed round of every arm" if p.get("warm_up") else ""
    page.add(
        _provenance(result),
        "",
        f"One {_binary(p['size_bytes'])} random blob put and then got, {p['repetitions']} "
        f"repetition(s) with the arms' order rotating{warm}, through `S3Mailbox` on a moto "
        "server at 127.0.0.1 and through `LocalMailbox` on a temporary directory. "
        "`parallel` is the mailbox as configured by default (S3: parts of "
        f"{_binary(s3['part_size'])}, "
        f"{s3['part_concurrency']} at once, above {_binary(s3['multipart_threshold'])}; "
        "local: 16 MiB chunks off the event loop); `single` is the same mailbox's "
        "single-stream path (one PUT and one GET; one worker-thread hop); `raw` is the "
        "fastest raw client doing the same transfer (raw aiobotocore with the same parts and "
        "concurrency, into a `bytearray` it returns as is; plain files). Median MiB/s "
        "[min, max]; a ratio is the mailbox's median over the other arm's (above 1: the "
        "mailbox is faster). The raw aiobotocore arm runs under trio as well: aiobotocore's "
        "httpx backend is one code path on both loops.",
        "",
    )
    rows, ratios = [], []
    for loop, stores in f.items():
        for store, entry in stores.items():
            for op in ("put", "get"):
                arms = entry[op]["mib_per_s"]
                ratios.append((f"{loop} {store} {op}", entry[op]["ratio_vs_raw"]))
                rows.append(
                    [
                        loop,
                        store,
                        op,
                        *[_spread(arms[a], 0) for a in ("parallel", "single", "raw")],
                        _num(entry[op]["ratio_vs_single"], 2),
                        _num(entry[op]["ratio_vs_raw"], 2),
                    ]
                )
    page.add(
        *_table(["loop", "store", "op", "parallel", "single", "raw", "÷ single", "÷ raw"], rows),
        "On moto at 127.0.0.1 there is no network: client and server share the machine's "
        "cores, and moto answers each ranged GET by reading the whole object and slicing it "
        "(N ranges cost it N whole reads), so `÷ single` says what the parallel path costs "
        "here, not what it gains on S3, where one stream is limited by per-connection "
        "bandwidth and parallel ranges are AWS's advice. `÷ raw` is the mailbox's own "
        "overhead against the same requests made bare.",
        "",
    )
    sweep = result.get("sweep")
    if sweep:
        page.add(
            f"Sweep of the S3 part size and concurrency ({_binary(sweep['size_bytes'])}, one "
            "run each, asyncio, MiB/s):",
            "",
            *_table(
                ["part size", "concurrency", "put", "get"],
                [
                    [
                        _binary(row["part_size"]),
                        str(row["concurrency"]),
                        _num(row["put_mib_per_s"], 0),
                        _num(row["get_mib_per_s"], 0),
                    ]
                    for row in sweep["rows"]
                ],
            ),
        )
    worst = min(ratios, key=lambda item: item[1] if item[1] is not None else math.inf)
    met = all(r is not None and r >= result["target_ratio_vs_raw"] for _, r in ratios)
    page.target(
        f"large transfers ({_binary(p['size_bytes'])}) ÷ raw client",
        f"≥ {result['target_ratio_vs_raw']}",
        f"lowest {_num(worst[1], 2)} ({worst[0]})",
        met,
        "every loop, store and op at or above the raw client's 0.9"
        if met
        else f"{worst[0]} below: see section 11 (moto on a shared 2-core machine)",
    )


def large_fragments(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 12. Memory and round latency of large fragments", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/memory.json` is missing._", "")
        page.target("peak memory against P", "linear, at the bound", "–", None, "not run")
        return
    f = result["figures"]
    page.add(
        _provenance(result),
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
    rows = []
    for role, entry in f["memory"].items():
        for size, point in entry["points"].items():
            rows.append(
                [
                    role,
                    f"{int(size):,}",
                    _bytes(point["start"]),
                    _bytes(point["peak"]),
                    _num(point["above_start_per_param"], 2),
                    _num(point["seconds"], 2),
                ]
            )
    page.add(
        *_table(["role", "parameters", "start", "peak", "above start, B/param", "seconds"], rows),
    )
    for role, entry in f["memory"].items():
        fit = entry["fit_above_start"]
        page.add(
            f"- `{role}`: least-squares slope **{_num(fit['slope'], 2)} bytes per parameter** "
            f"above the held state (bound {_num(entry['bound_per_param'], 2)}), intercept "
            f"{_bytes(max(fit['intercept'], 0.0))}, R² {_num(fit['r2'], 4)}; whole-process "
            f"slope {_num(entry['fit_peak']['slope'], 2)} B/param."
        )
        page.target(
            f"peak memory of `{role}` against P",
            f"linear (R² > 0.99), slope within 10% of the bound "
            f"{_num(entry['bound_per_param'], 2)} B/param",
            f"{_num(fit['slope'], 2)} B/param, R² {_num(fit['r2'], 3)}",
            fit["r2"] > 0.99 and fit["slope"] <= 1.1 * entry["bound_per_param"],
            "no whole temporary copy: the pieces are the constant part",
        )
    page.add("")
    latency = f.get("latency")
    if latency:
        page.add(
            f"**Round latency** of a run of one fragment of {latency['size']:,} parameters "
            f"(int8 deltas and updates) on a `LocalMailbox`: {latency['learners']} "
            "learner-only processes and one syncer-only process, from a round's last "
            "snapshot landing to the first learner seeing its record (wall clock, one "
            "machine, poll 50 ms). It spans the syncer's reads of the snapshots, the "
            "aggregation, the outer step, the update and the fp32 θ and outer state written, "
            "and the record.",
            "",
            *_table(
                ["rounds", "p50", "max", "first round", "syncer peak", "learner peak"],
                [
                    [
                        str(len(latency["values_s"])),
                        f"{_num(latency['p50_s'], 2)} s",
                        f"{_num(latency['max_s'], 2)} s",
                        f"{_num(latency['first_round_s'], 2)} s",
                        f"{_num(latency['syncer_peak_per_param'], 1)} B/param",
                        f"{_num(latency['learner_peak_per_param'], 1)} B/param",
                    ]
                ],
            ),
        )


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
        _provenance(result),
        "",
        f"Section 1's task and model ({p['params']:,} parameters, {p['steps']} steps, "
        f"{p['learners']} learners, seed {p['seeds'][0]}), H {p['sync_every'][0]}. "
        "`topkN`: deltas at N% density, 2 bits, chunks of 4096, error feedback, plain "
        "averaging (no momentum) at outer lr 2, updates in `topk` (the union of the "
        "selections); `lrX`: the same at outer lr X; `nag`: the default Nesterov step "
        "(1.0 / 0.6) with int8 updates (its update is dense). Bytes per learner "
        "are measured, up and down; the delta and update columns are the mean blob sizes; "
        "peak storage is the largest size of the run's directory (sampled every 0.1 s) over "
        "the model's fp32 size.",
        "",
    )
    rows = []
    for arm, entry in figures["arms"].items():
        run = figures["per_seed"][arm][str(p["seeds"][0])]
        gm = arm.startswith("gm-")
        rows.append(
            [
                arm,
                _num(entry["final_loss"]["median"], 4),
                _num(entry["excess_ratio_vs_dp"]["median"], 3) if arm != "dp" else "1",
                _bytes(run["bytes_up_per_learner"]) if gm else "–",
                _bytes(run["bytes_down_per_learner"]) if gm else "–",
                _num(entry["bytes_ratio_dp_over_gm"]["median"], 0) if gm else "–",
                _num(entry["bytes_ratio_with_syncer_share"]["median"], 0) if gm else "–",
                _bytes(run["mean_delta_bytes"]) if gm else "–",
                _bytes(run["mean_update_bytes"]) if gm else "–",
                _num(run["peak_store_bytes"] / (4 * p["params"]), 2) if gm else "–",
            ]
        )
    page.add(
        *_table(
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


def _section_result(results: Path, name: str) -> dict[str, Any] | None:
    if name == "text":
        return _text_results(results)
    if name == "text-seeds":
        return _text_seed_results(results)
    if name in ("transfer", "memory", "rejoin"):
        # The large run (its own nox session) where there is one.
        return _load(results, f"{name}-large") or _load(results, name)
    return _load(results, name)


def generate(results: Path, docs: Path) -> Path:
    """Write ``docs/benchmarks.md`` and its plots from ``results``; returns the page."""
    page = Page(docs)
    sections: list[tuple[Callable[[Page, dict[str, Any] | None], None], str]] = [
        (convergence, "convergence"),
        (step_overhead, "overhead"),
        (store, "store"),
        (rounds, "rounds"),
        (events, "events"),
        (text, "text"),
        (defaults_grid, "convergence-grid"),
        (text_seeds, "text-seeds"),
        (groups, "groups"),
        (convergence_bytes, "convergence-bytes"),
        (convergence_sparse, "convergence-sparse"),
        (transfer, "transfer"),
        (large_fragments, "memory"),
        (rejoin, "rejoin"),
        (report_fleet.fleets, "fleet"),
    ]
    body = Page(docs)
    for section, name in sections:
        section(body, _section_result(results, name))
    quick = any((_load(results, n) or {}).get("quick") for _, n in sections)
    page.add(
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/report.py from benchmarks/results/*.json; do not edit. -->",
        "",
        "Regenerate with `nox -s bench` (the full run) or "
        "`.venv/bin/python benchmarks/run.py [--quick]`; `benchmarks/report.py` alone "
        "rewrites this page from the JSON files. Every comparison is a ratio of two "
        "measures taken in the same run on the same machine.",
        "",
    )
    run = _load(results, "run")
    if run is not None:
        seconds = run["figures"]["seconds"]
        page.add(
            f"The {'quick' if run['quick'] else 'full'} run (finished {run['date']}, commit "
            f"`{run['git_commit'][:12]}`) took {run['figures']['total_seconds'] / 60:.1f} "
            "minutes on this machine ("
            + ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
            + "), shared with other work: each section gives the 1-minute load average at "
            "its start and end."
            + (
                f" Failed: {', '.join(run['figures']['failed'])}."
                if run["figures"]["failed"]
                else ""
            ),
            "",
        )
        for _, name in sections:
            other = _load(results, name)
            if other is not None and other["git_commit"] != run["git_commit"]:
                page.add(
                    f"- `{name}.json` was measured apart from that run: {other['date']}, "
                    f"commit `{other['git_commit'][:12]}`.",
                )
        page.add("")
    if quick:
        page.add(
            "> **Some results below come from the quick variant** (smoke-test sizes); they "
            "are labelled where they appear and are not the full run's figures.",
            "",
        )
    page.add(
        "## Targets", "", *_table(["figure", "target", "measured", "verdict", "by"], body.targets)
    )
    page.add(*body.lines)
    path = docs / PAGE
    path.write_text("\n".join(page.lines).rstrip() + "\n", encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=h.RESULTS)
    parser.add_argument("--docs", type=Path, default=h.DOCS)
    args = parser.parse_args()
    print(f"wrote {generate(args.results, args.docs)}")


if __name__ == "__main__":
    main()
