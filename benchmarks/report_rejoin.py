"""The page's section 13, a new learner's join against the raw read of the same blobs
(``bench_rejoin.py``'s results)."""

from typing import Any

from _page import Page, byte_size, provenance, spread, table


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
        provenance(result),
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
                    byte_size(entry["bytes_read"]),
                    spread(entry["join_seconds"], 2),
                    spread(entry["raw_seconds"], 2),
                    spread(entry["join_over_raw"], 2),
                ]
            )
    page.add(
        *table(
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
