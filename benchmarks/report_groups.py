"""The page's section 9, learner groups: a learner of two processes (DDP, and FSDP2 when
measured) against a learner of one (``bench_groups.py``'s results)."""

from collections.abc import Callable
from typing import Any

from _page import Page, byte_size, num, provenance, spread, table

ROLE = {
    "group_leader": "DDP: leader",
    "group_follower": "DDP: follower",
    "fsdp_leader": "FSDP2: rank 0",
    "fsdp_follower": "FSDP2: rank 1",
    "single_leader": "single learner",
}


def _rows(f: dict[str, Any], roles: tuple[str, ...]) -> list[list[str]]:
    def row(label: str, key: str, show: Callable[[Any], str]) -> list[str]:
        shown = [show(f[r][key]) if f[r].get(key) is not None else "—" for r in roles]
        return [label, *shown]

    return [
        row("`step()` on the caller, p50", "step_ms_p50", lambda v: f"{num(v, 2)} ms"),
        row("`step()` on the caller, mean", "step_ms_mean", lambda v: f"{num(v, 2)} ms"),
        row("`step()` on the caller, p99", "step_ms_p99", lambda v: f"{num(v, 2)} ms"),
        row("store bytes written", "store_up", byte_size),
        row("store bytes read", "store_down", byte_size),
        row("group collectives, bytes sent", "group_sent", byte_size),
        row("group collectives, bytes received", "group_received", byte_size),
        row("publishing one fragment (median)", "publish_s_median", lambda v: f"{num(v, 4)} s"),
        row("peak resident memory", "peak_rss_bytes", byte_size),
        row("parameters held", "param_bytes", byte_size),
        row("snapshot bytes uploaded (from the store)", "snapshot_up", byte_size),
        row("bytes of one snapshot (its part, from the store)", "snapshot_bytes", byte_size),
    ]


def _sharded(f: dict[str, Any]) -> list[str]:
    """The FSDP2 arm's sentences, when the results have it."""
    if "fsdp_leader" not in f:
        return []
    return [
        "In the *fsdp* arm each learner's parameters are cut in two by `fully_shard` (a CPU "
        "mesh): every rank runs the learner over its own rows, uploads its rows of each "
        "snapshot as a part and reads its rows of every version by byte ranges. Each rank "
        f"held {num(f['fsdp_leader_param_ratio'], 2)}× a single learner's parameter bytes "
        f"and uploaded {num(f['fsdp_leader_snapshot_up_ratio'], 3)}× (rank 0) and "
        f"{num(f['fsdp_follower_snapshot_up_ratio'], 3)}× (rank 1) the bytes of a single "
        "learner's snapshot, for each of its snapshots; rank 1 read "
        f"{num(f['fsdp_follower_store_down_ratio'], 2)}× what a single learner read (its rows "
        "of every version, their chunk indexes and blob headers; rank 0 also reads as the "
        "learner's syncer). A sharded `step()` (a tick: one all-reduce, plus the leader's "
        "log and the ranks' part reports when there are any) cost "
        f"{num(f['fsdp_step_ms_added_p50'], 2)} ms more than a single learner's at the "
        "median; publishing one fragment took "
        f"{num(f['fsdp_leader']['publish_s_median'], 4)} s on the leader (its own part "
        "encoded and uploaded, then the other rank's report, which travels at its next "
        "`step()`, then the snapshot written). The final loss ratio (fsdp ÷ single) is "
        f"{num(f['fsdp_loss_ratio'], 3)}.",
        "",
    ]


TRAIN = {1: "One learner trains", 2: "Two learners train"}
"""The section's opening words, by the learners of a run (one in the quick variant)."""


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
    roles = tuple(r for r in ROLE if r.split("_")[0] in arms)
    page.add(
        provenance(result),
        "",
        f"{TRAIN[p['learners']]} the demo's model ({p['model']}, context {p['context']}) on its "
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
        *table(["figure", *[ROLE[role] for role in roles]], _rows(f, roles)),
        *_arms_table(f, arms),
        *_cost(f),
        *_sharded(f),
    )


def _arms_table(f: dict[str, Any], arms: list[str]) -> list[str]:
    return table(
        ["figure", *arms],
        [
            [
                "final evaluation loss (nats), median of learners and runs",
                *[spread(f[f"{arm}_eval_loss"], 3) for arm in arms],
            ],
            ["rounds committed", *[num(f[f"{arm}_rounds"], 1) for arm in arms]],
            ["wall time of a run", *[f"{num(f[f'{arm}_seconds']['median'], 1)} s" for arm in arms]],
        ],
    )


def _cost(f: dict[str, Any]) -> list[str]:
    """What a group costs against a single learner."""
    return [
        f"A group's `step()` costs {num(f['step_ms_added_p50'], 2)} ms more than a single "
        "learner's at the median: one all-reduce of a few ints (the leader's decision) "
        "between two processes and the hop into a worker thread, plus, once per round, the "
        "broadcast of the fragment the round changed. The leader's store traffic is "
        f"{num(f['leader_store_up_ratio'], 3)}× the single learner's (written bytes): a "
        "group is one learner to the run. The final loss ratio (group ÷ single) is "
        f"{num(f['loss_ratio'], 3)}: the arms see the same data and the same mean "
        "gradients, so what differs is the order of float sums and the timing of rounds.",
        "",
    ]
