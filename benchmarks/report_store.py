"""The page's section 3, the mailboxes' throughput against their baselines
(``bench_store.py``'s results), with the cause of each ratio under the target."""

from typing import Any

from _page import Page, num, provenance, table

Miss = tuple[str, str, str, str, float, dict[str, Any] | None, bool]
"""A ratio under the target: backend, store, operation, size, ratio, its per-repetition
spread, and whether the objects are small."""

CAUSES = {
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


def store(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 3. Store throughput", "")
    if result is None:
        page.add("_Not measured: `benchmarks/results/store.json` is missing._", "")
        return
    p = result["parameters"]
    page.add(
        provenance(result),
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
    misses: list[Miss] = []
    for backend, stores in result["figures"].items():
        for name, sizes in stores.items():
            for size, entry in sizes.items():
                for op in ("list",) if size == "list" else ("put", "get"):
                    row, value, per_repetition = _row(backend, name, size, entry, op)
                    rows.append(row)
                    bars.append((f"{backend} {name} {row[2]}", value))
                    if value is not None and value < result["target_ratio"]:
                        small = op == "list" or entry["size_bytes"] < 1 << 16
                        misses.append((backend, name, op, size, value, per_repetition, small))
    page.add(
        *table(
            ["loop", "store", "operation", "mailbox", "baseline", "ratio", "per repetition"],
            rows,
        )
    )
    _plot(page, bars, result["target_ratio"])
    if misses:
        page.add(*_notes(misses, result["target_ratio"]))
    _targets(page, result)


def _row(
    backend: str, name: str, size: str, entry: dict[str, Any], op: str
) -> tuple[list[str], float, dict[str, Any] | None]:
    """One operation's table row, its ratio and the ratio's per-repetition spread."""
    if op == "list":
        mailbox, baseline = entry["mailbox"]["keys_per_s"], entry["baseline"]["keys_per_s"]
        unit, value = "keys/s", entry["ratio"]
        label = f"list {entry['keys']:,}"
        per_repetition = entry.get("ratio_per_repetition")
    else:
        measure = "mib_per_s" if entry["size_bytes"] >= 1 << 16 else "ops_per_s"
        mailbox = entry[op]["mailbox"][measure]
        baseline = entry[op]["baseline"][measure]
        unit = "MiB/s" if measure == "mib_per_s" else "ops/s"
        value = entry[op]["ratio"]
        per_repetition = entry[op].get("ratio_per_repetition")
        label = f"{op} {size}"
    row = [
        backend,
        name,
        label,
        f"{num(mailbox['median'], 1)} {unit}",
        f"{num(baseline['median'], 1)} {unit}",
        num(value, 2),
        f"{num(per_repetition['min'], 2)} – {num(per_repetition['max'], 2)}"
        if per_repetition
        else "–",
    ]
    return row, value, per_repetition


def _plot(page: Page, bars: list[tuple[str, float]], target: float) -> None:
    def draw(figure: Any) -> None:
        axes = figure.add_subplot(1, 1, 1)
        labels = [label for label, _ in bars]
        values = [value for _, value in bars]
        colors = ["tab:green" if v >= target else "tab:red" for v in values]
        axes.barh(range(len(values)), values, color=colors)
        axes.set_yticks(range(len(values)), labels, fontsize=6)
        axes.axvline(target, color="k", linestyle="--", linewidth=0.8)
        axes.axvline(1.0, color="grey", linewidth=0.5)
        axes.invert_yaxis()
        axes.set_xlabel("mailbox throughput ÷ baseline throughput (dashed: target)")
        axes.set_title("Store throughput ratios")

    page.plot("store.png", draw, "store throughput ratios")


def _targets(page: Page, result: dict[str, Any]) -> None:
    target = result["target_ratio"]
    for name, worst in result["worst"].items():
        page.target(
            f"store throughput: {name} ÷ baseline, worst case",
            f"≥ {target}",
            f"{num(worst['ratio'], 2)} ({worst['where'].replace('list list', 'list')})",
            worst["ratio"] >= target,
            "" if worst["ratio"] >= target else f"{100 * (1 - worst['ratio'] / target):.0f}% under",
        )


def _notes(misses: list[Miss], target: float) -> list[str]:
    lines = [f"Where a ratio is under the {target} target, by how much and why:", ""]
    for backend, name, op, size, value, per_repetition, small in misses:
        cause = CAUSES.get((name, op, "small" if small else "large")) or CAUSES.get(
            (name, op), "cause not analysed"
        )
        noisy = per_repetition is not None and per_repetition["max"] >= target
        where = "list" if op == "list" else f"{op} {size}"
        lines.append(
            f"- {name} {where} on {backend}: {num(value, 2)}, "
            f"{100 * (1 - value / target):.1f}% under; "
            + (
                f"single repetitions reached {num(per_repetition['max'], 2)}, so part of it is "
                "noise on a shared machine; "
                if noisy and per_repetition is not None
                else ""
            )
            + cause
            + "."
        )
    return [*lines, ""]
