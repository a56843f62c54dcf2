"""The page's section 2, what a node costs a training loop (``bench_overhead.py``'s
results): steps per second with and without it, ``step()`` on the caller, and the idle
node's CPU."""

from typing import Any

from _page import Page, byte_size, num, provenance, spread, table


def step_overhead(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 2. Step overhead", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/overhead.json` is missing._", "")
        return
    p, f = result["parameters"], result["figures"]
    page.add(
        provenance(result),
        "",
        f"One training loop ({p['model']}, {p['params']:,} parameters, batch "
        f"{p['batch']} × {p['context']} tokens, AdamW) run bare and with a node (one "
        f"learner that is also its own syncer, `LocalMailbox`, F={p['fragments']}, "
        f"H={p['sync_every']}, `{p['encoding']}`), in segments of {p['segment_steps']} steps "
        f"that alternate between the two ({p['segments']} of each), driven from a worker "
        "thread through `node.run_in_thread` as a synchronous loop would be. The time of "
        "`step()` is measured on the caller, around each call.",
        "",
        *table(
            ["figure", "value"],
            [
                ["steps/s, bare", spread(f["steps_per_s_bare"], 2)],
                ["steps/s, with the node", spread(f["steps_per_s_node"], 2)],
                ["ratio (node ÷ bare), median of segment pairs", spread(f["ratio"], 3)],
                ["`step()` on the caller, p50", f"{num(f['step_ms_p50'], 2)} ms"],
                ["`step()` on the caller, p99", f"{num(f['step_ms_p99'], 2)} ms"],
                ["`step()` on the caller, max", f"{num(f['step_ms_max'], 2)} ms"],
                ["training step, bare, p50", f"{num(f['train_ms_p50'], 1)} ms"],
                ["rounds committed during the node segments", str(f["rounds_committed"])],
            ],
        ),
    )
    if f["ratio"]["median"] < result["target_ratio"]:
        page.add(*_missed(result))
    if "idle" in f:
        page.add(*_idle(p, f))
    _target(page, result)


def _missed(result: dict[str, Any]) -> list[str]:
    """Where the time beyond the target went."""
    f = result["figures"]
    ratio = f["ratio"]["median"]
    step_ms = 1e3 / f["steps_per_s_node"]["median"]
    caller = f["step_ms_mean"] / step_ms
    return [
        f"The target is missed by {100 * (result['target_ratio'] - ratio):.1f} points. "
        f"`step()` itself took {num(f['step_ms_mean'], 2)} ms on average, "
        f"{100 * caller:.1f}% of a {num(step_ms, 0)} ms step with the node; the rest "
        f"of the {100 * (1 - ratio):.1f}% is CPU time that the node's tasks take from "
        "the training on the same cores: encoding and hashing each snapshot and, as "
        "its own syncer, decoding, the outer step and writing θ, the outer state and "
        f"the update of each of the {f['rounds_committed']} rounds "
        f"({byte_size(f['bytes_published'])} written in all). The per-pair ratios "
        f"({', '.join(num(v, 3) for v in f['ratio']['values'])}) show how much the "
        "shared machine's load moved between segments.",
        "",
    ]


def _idle(p: dict[str, Any], f: dict[str, Any]) -> list[str]:
    """The CPU of a node with nothing to do, per poll interval."""
    return [
        "What a node costs while nothing happens (no steps; the product's lease pacing, "
        f"every {num(p.get('idle_lease_every', 2.0), 0)} s): the CPU time of every "
        "thread of the process over "
        f"{num(p['idle_seconds'], 0)} s, less the same process's with no node "
        f"({num(f['idle_baseline_core_percent'], 2)}% of a core), in percent of one "
        "core. The learner lists the round records at every poll; the syncer reads the "
        "round it is closing (its record, its snapshots, and the next rounds' while it is "
        "empty). On a machine where training has every core, this is what it loses.",
        "",
        *table(
            ["poll interval", "learner", "dedicated syncer"],
            [
                [
                    f"{poll} s",
                    f"{num(idle['learner_core_percent'], 2)}%",
                    f"{num(idle['syncer_core_percent'], 2)}%",
                ]
                for poll, idle in f["idle"].items()
            ],
        ),
    ]


def _target(page: Page, result: dict[str, Any]) -> None:
    ratio, target = result["figures"]["ratio"], result["target_ratio"]
    page.target(
        "step overhead: steps/s with node ÷ bare",
        f"≥ {target}",
        spread(ratio, 3),
        ratio["median"] >= target,
        "" if ratio["median"] >= target else f"{100 * (target - ratio['median']):.1f} points under",
    )
