"""The page's section 6, real text against torchft's DiLoCo (``bench_text.py``'s results):
each size measured, its arms, and gradientmail against torchft."""

import math
from pathlib import Path
from typing import Any

import bench_text
import report_fair
import report_text_sparse
import report_text_versus
from _page import Page, byte_size, load, num, provenance, table
from report_text_runs import gm_pacing, gm_syncer, produced, text_label, text_order

TEXT_SIZES = ("full", "medium", "small")
"""The real-text sizes the page shows, each from its own result file when it exists."""

FULL_SIZE = "real text (full size): every arm, the torchft ratios and the failure side by side"


def text_results(results: Path) -> dict[str, Any] | None:
    """Each real-text size's result (``text.json`` for the full size, ``text-{size}.json``
    for the others), with its fp32 pairs in both orders under ``timing``
    (``text-timing-{size}.json``, None when not measured), or None when there is none."""
    found = {}
    for size in TEXT_SIZES:
        result = load(results, "text" if size == "full" else f"text-{size}")
        fair = load(results, f"text-fair-{size}")
        if result is not None or fair is not None:
            found[size] = (result or {}) | {
                "timing": load(results, f"text-timing-{size}"),
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
    _full_size(page, by_size.get("full"))
    for size, result in by_size.items():
        page.add(f"### Size `{size}`", "")
        if result.get("fair") is not None:
            report_fair.section(page, result["fair"])
        if "parameters" in result:
            size_section(page, result)


def _full_size(page: Page, result: dict[str, Any] | None) -> None:
    """The full size's target: every arm measured."""
    if result is None:
        page.add(
            "_The full size (a 1M-parameter GPT, 1,000 steps, every arm) is not measured: "
            "`nox -s bench-text` runs it. A full-size step costs about 22 medium ones (one "
            "learner alone: 126 s against 5.6 s for 1,000 steps on an idle core), so on two "
            "idle cores the headline arms (data-parallel, single, gradientmail and torchft "
            "at fp32 H=100) take 22 minutes and every arm about an hour and a half._",
            "",
        )
        page.target(
            FULL_SIZE,
            "measured",
            "not run (sizes small and medium only)",
            None,
            "nox -s bench-text; see section 6",
        )
        return
    p = result["parameters"]
    every = bench_text.arms(p)  # the size's settings are in its parameters
    left = [arm for arm in every if arm not in p["arms"]]
    page.target(
        FULL_SIZE,
        "measured",
        f"{len(every) - len(left)} of {len(every)} arms"
        + (f"; not run: {', '.join(left)}" if left else ""),
        not left,
        "nox -s bench-text; see section 6",
    )
    report_text_sparse.targets(page, result)


def size_section(page: Page, result: dict[str, Any]) -> None:
    """One size: every arm, gradientmail ÷ torchft, the failure and the ordering."""
    p, figures = result["parameters"], result["figures"]
    size = p["size"]
    scale = (
        ""
        if size == "full"
        else f" **Size `{size}`: a scaled-down run (the full size is 1,000 steps of a "
        "1M-parameter model), so its figures check the harness and the orderings, not the "
        "full-size losses.**"
    )
    if not report_fair.fair(result):
        page.add(*report_fair.earlier(size))
    page.add(
        provenance(result),
        "",
        _task(result) + _measures(result) + _polls(result) + scale,
        "",
        *produced(result),
    )
    page.add(*_arms_table(result))
    report_text_versus.versus(page, result)
    if result.get("timing") is not None:
        report_text_versus.timing(page, result["timing"])
    report_text_versus.failure(page, figures["failure"], figures["arms"], p)
    _plot(page, figures["arms"], size)


def _task(result: dict[str, Any]) -> str:
    p = result["parameters"]
    model = p["model"]
    return (
        f"A byte-level GPT (d_model {model['d_model']}, {model['n_layers']} layers, "
        f"{model['n_heads']} heads, context {model['context']}; {p['params']:,} parameters) "
        f"learns the Python standard library's own source ({p['corpus']}); a file is held out "
        "for validation by a hash of its path. "
        f"Seed {p.get('seed', 0)}: {p['learners']} learners, {p['steps']} steps each, batch "
        f"{p['batch']} windows, AdamW "
        f"at {p['lr']} with warm-up and cosine decay; {p['fragments']} fragments "
        f"(`{p['pattern']}`) in both systems, outer Nesterov SGD "
        f"{p.get('outer_lr', 0.7)} / {p.get('outer_momentum', 0.9)} in both. "
        + gm_pacing(result)
        + "Data-parallel trains one model on the union of the learners' batches. "
        + gm_syncer(result)
        + "torchft runs each learner as its own replica group with `torchft.local_sgd.DiLoCo`, "
        "its lighthouse process and gloo on 127.0.0.1. "
    )


def _measures(result: dict[str, Any]) -> str:
    """How bytes, time and CPU are counted."""
    return (
        "Bytes per learner: gradientmail's "
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
        "torchft's learners, not its lighthouse process). "
    )


def _polls(result: dict[str, Any]) -> str:
    """gradientmail's poll and lease pacing, and what the lag column is."""
    p, arms = result["parameters"], result["figures"]["arms"]
    pacing = p.get("pacing", {"poll_interval": p.get("poll_interval", 0.05)})
    return (
        "gradientmail's nodes poll "
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
    )


def _arms_table(result: dict[str, Any]) -> list[str]:
    p, figures = result["parameters"], result["figures"]
    by_arm, arms = figures["table"], figures["arms"]
    dp_bytes = by_arm.get("dp", {}).get("bytes_per_learner")
    rows = [
        _row(arm, by_arm[arm], arms[arm], p, dp_bytes) for arm in sorted(by_arm, key=text_order)
    ]
    header = ["arm", "validation bits/byte", "excess over DP", "beats single", "wall (s)"]
    header += ["train (s)", "bytes per learner", "DP bytes ÷ these", "peak storage ÷ fp32 model"]
    return table([*header, "rounds / syncs"], rows)


def _row(
    arm: str, entry: dict[str, Any], run: dict[str, Any], p: dict[str, Any], dp_bytes: Any
) -> list[str]:
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
    return [
        text_label(arm),
        num(entry["bits_per_byte"], 4),
        num(entry.get("excess_over_dp"), 4),
        {True: "yes", False: "**no**", None: "–"}[entry.get("beats_single")],
        num(entry["wall_seconds"], 0),
        num(entry["train_seconds"], 1),
        byte_size(entry["bytes_per_learner"]) if entry["bytes_per_learner"] else "–",
        num(dp_bytes / entry["bytes_per_learner"], 0)
        if dp_bytes and entry["bytes_per_learner"] and arm.startswith("gm-")
        else "–",
        num(run["peak_store_bytes"] / (4 * p["params"]), 2)
        if run.get("peak_store_bytes") and p.get("params")
        else "–",
        sync,
    ]


def _plot(page: Page, arms: dict[str, Any], size: str) -> None:
    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        for arm in sorted(arms, key=text_order):
            if arm.endswith("-kill") or (arm.startswith("gm-") and arm.split("-")[1] != "fp32"):
                continue
            curve = arms[arm]["curve"]
            style = {"dp": "k-", "single": "k:"}.get(arm, "--" if "torchft" in arm else "-")
            axes.plot(
                [x for x, _ in curve],
                [y / math.log(2) for _, y in curve],
                style,
                label=text_label(arm),
                linewidth=1.2,
            )
        axes.set_xlabel("steps per learner")
        axes.set_ylabel("validation bits per byte")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
        axes.set_title(f"Real text, size {size}: validation loss against steps (fp32)")

    page.plot(f"text-{size}.png", draw, f"validation bits per byte against steps, size {size}")
