"""The page's section 4, round latency and the store requests of a growing run
(``bench_rounds.py``'s results)."""

from typing import Any

from _page import Page, num, provenance, table


def rounds(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 4. Round latency and scale", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/rounds.json` is missing._", "")
        return
    p, f = result["parameters"], result["figures"]
    page.add(provenance(result), "")
    if f.get("latency"):
        page.add(*_latency(p, f["latency"]))
    scale = f.get("scale")
    if scale:
        page.add(*_scale_text(p), *_scale_table(scale))
        _plot(page, scale)


def _latency(p: dict[str, Any], latency: dict[str, Any]) -> list[str]:
    return [
        "**Round latency**: from the moment the put of a round's last snapshot returned "
        "to the moment a learner's listing or read first returned that round's record, on a "
        f"`{p['latency_store']}`, with {p['latency_learners']} learners that step in "
        f"lockstep, one fragment per round (F={p['latency_fragments']}, "
        f"{p['latency_encoding']} deltas and updates), each learner also a syncer, poll "
        f"interval {p['poll_interval']} s (up to that much of the latency is the poll). "
        "The latency spans the closing syncer's poll, reading and decoding the snapshots, "
        "the outer step, encoding and hashing θ, the outer state and the update, writing "
        "them and the record, and a learner's poll. The first round is shown apart: it "
        "also pays for the syncers' first loads of θ and the outer state.",
        "",
        *table(
            ["fragment size", "rounds", "p50", "p90", "max", "first round"],
            [
                [
                    f"{int(size):,} parameters",
                    str(entry["rounds"]),
                    f"{num(entry['p50_s'] * 1e3, 0)} ms",
                    f"{num(entry['p90_s'] * 1e3, 0)} ms",
                    f"{num(entry['max_s'] * 1e3, 0)} ms",
                    f"{num(entry['first_round_s'] * 1e3, 0)} ms",
                ]
                for size, entry in latency.items()
            ],
        ),
    ]


def _scale_text(p: dict[str, Any]) -> list[str]:
    syncers = (
        f"the first {p['scale_syncers']} also syncers, the others learner-only"
        if p.get("scale_syncers")
        else "each also a syncer"
    )
    return [
        f"**Scale**: N simulated learners in one process, each a full node "
        f"({syncers}), on a `MemoryMailbox` wrapped to count every request, "
        f"{p['scale_model']} ({p['scale_params']:,} parameters), F={p['scale_fragments']}, "
        f"H={p['scale_sync_every']}, poll interval "
        f"{p.get('scale_poll_interval', p['poll_interval'])} s; the learners step in "
        f"lockstep every {p['scale_tick_s'] * 1e3:.0f} ms for {p['scale_seconds']} s "
        f"after {p['scale_warmup_s']} s of warm-up; the requests of every node in that "
        "window are divided by the rounds whose record was first seen in it. Polls are "
        "paced by time, not by rounds, so requests per round compare across N only "
        "while the rounds keep the tick's pace (the `kept pace` column: at least 90% of "
        "the nominal rate); a process that cannot keep up closes fewer rounds while its "
        "nodes keep polling.",
        "",
    ]


def _scale_table(scale: dict[str, Any]) -> list[str]:
    kinds = sorted({k for entry in scale["by_n"].values() for k in entry["per_round"]})
    rows = [
        [
            n,
            str(entry["rounds"]),
            num(entry["rounds_per_s"], 2),
            num(entry["requests_per_round"], 1),
            *[num(entry["per_round"].get(k, 0.0), 1) for k in kinds],
            num(entry["requests_per_round_per_learner"], 2),
            num(entry.get("requests_per_s_per_learner"), 1),
            {True: "yes", False: "**no**", None: "–"}[entry.get("kept_pace")],
        ]
        for n, entry in scale["by_n"].items()
    ]
    header = ["N", "rounds", "rounds/s", "requests/round", *[f"{k}/round" for k in kinds]]
    header += ["requests/round/learner", "requests/s/learner", "kept pace"]
    return [
        *table(header, rows),
        _fit_text(scale),
        "",
    ]


def _fit_text(scale: dict[str, Any]) -> str:
    if "fit" not in scale:
        return "No fit: fewer than two sizes kept the tick's pace."
    fit = scale["fit"]
    over = ", ".join(str(n) for n in scale["fit_ns"])
    return (
        f"Least-squares fit of requests per round against N (N = {over}, the sizes that "
        f"kept pace): slope **{num(fit['slope'], 2)} requests per round per learner**, "
        f"intercept {num(fit['intercept'], 1)}, R² {num(fit['r2'], 4)}."
    )


def _plot(page: Page, scale: dict[str, Any]) -> None:
    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        ns = [int(n) for n in scale["by_n"]]
        ys = [entry["requests_per_round"] for entry in scale["by_n"].values()]
        axes.plot(ns, ys, "o", label="measured")
        if "fit" in scale:
            fit = scale["fit"]
            axes.plot(ns, [fit["slope"] * n + fit["intercept"] for n in ns], "-", label="fit")
        axes.set_xlabel("learners N")
        axes.set_ylabel("store requests per round")
        axes.grid(True, alpha=0.3)
        axes.legend()
        axes.set_title("Requests per round against learners")

    page.plot("scale.png", draw, "requests per round against learners")
