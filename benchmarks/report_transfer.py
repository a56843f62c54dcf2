"""The page's section 11, large transfers through the mailboxes against the raw clients
(``bench_transfer.py``'s results)."""

import math
from typing import Any

from _page import Page, num, provenance, spread, table


def binary(value: float) -> str:
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
    s3, local = next(iter(f.values()))["s3"], next(iter(f.values()))["local"]["write_chunk"]
    configured = "with smaller parts (quick)" if result["quick"] else "as configured by default"
    warm = ", after one untimed round of every arm" if p.get("warm_up") else ""
    page.add(
        provenance(result),
        "",
        f"One {binary(p['size_bytes'])} random blob put and then got, {p['repetitions']} "
        f"repetition(s) with the arms' order rotating{warm}, through `S3Mailbox` on a moto "
        "server at 127.0.0.1 and through `LocalMailbox` on a temporary directory. "
        f"`parallel` is the mailbox {configured} (S3: parts of "
        f"{binary(s3['part_size'])}, "
        f"{s3['part_concurrency']} at once, above {binary(s3['multipart_threshold'])}; "
        f"local: {binary(local)} chunks off the event loop); `single` is the same mailbox's "
        "single-stream path (one PUT and one GET; one worker-thread hop); `raw` is the "
        "fastest raw client doing the same transfer (raw aiobotocore with the same parts and "
        "concurrency, into a `bytearray` it returns as is; plain files). Median MiB/s "
        "[min, max]; a ratio is the mailbox's median over the other arm's (above 1: the "
        "mailbox is faster). The raw aiobotocore arm runs under trio as well: aiobotocore's "
        "httpx backend is one code path on both loops.",
        "",
    )
    rows, ratios = _rows(f)
    page.add(
        *table(["loop", "store", "op", "parallel", "single", "raw", "÷ single", "÷ raw"], rows),
        "On moto at 127.0.0.1 there is no network: client and server share the machine's "
        "cores, and moto answers each ranged GET by reading the whole object and slicing it "
        "(N ranges cost it N whole reads), so `÷ single` says what the parallel path costs "
        "here, not what it gains on S3, where one stream is limited by per-connection "
        "bandwidth and parallel ranges are AWS's advice. `÷ raw` is the mailbox's own "
        "overhead against the same requests made bare.",
        "",
    )
    if result.get("sweep"):
        page.add(*_sweep(result["sweep"]))
    _target(page, result, ratios)


def _rows(f: dict[str, Any]) -> tuple[list[list[str]], list[tuple[str, float | None]]]:
    """Every loop, store and op's row, and its ratio to the raw client."""
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
                        *[spread(arms[a], 0) for a in ("parallel", "single", "raw")],
                        num(entry[op]["ratio_vs_single"], 2),
                        num(entry[op]["ratio_vs_raw"], 2),
                    ]
                )
    return rows, ratios


def _sweep(sweep: dict[str, Any]) -> list[str]:
    return [
        f"Sweep of the S3 part size and concurrency ({binary(sweep['size_bytes'])}, one "
        "run each, asyncio, MiB/s):",
        "",
        *table(
            ["part size", "concurrency", "put", "get"],
            [
                [
                    binary(row["part_size"]),
                    str(row["concurrency"]),
                    num(row["put_mib_per_s"], 0),
                    num(row["get_mib_per_s"], 0),
                ]
                for row in sweep["rows"]
            ],
        ),
    ]


def _target(page: Page, result: dict[str, Any], ratios: list[tuple[str, float | None]]) -> None:
    p = result["parameters"]
    worst = min(ratios, key=lambda item: item[1] if item[1] is not None else math.inf)
    met = all(r is not None and r >= result["target_ratio_vs_raw"] for _, r in ratios)
    page.target(
        f"large transfers ({binary(p['size_bytes'])}) ÷ raw client",
        f"≥ {result['target_ratio_vs_raw']}",
        f"lowest {num(worst[1], 2)} ({worst[0]})",
        met,
        "every loop, store and op at or above the raw client's 0.9"
        if met
        else f"{worst[0]} below: see section 11 (moto on a shared 2-core machine)",
    )
