"""The page's section 5, the event bus (``bench_events.py``'s results)."""

from typing import Any

from _page import Page, num, provenance, table


def events(page: Page, result: dict[str, Any] | None) -> None:
    page.add("## 5. Event bus", "")
    if result is None:
        page.add("_Not measured here: `benchmarks/results/events.json` is missing._", "")
        return
    page.add(
        provenance(result),
        "",
        "Measured by `benchmarks/bench_events.py` (see its docstring); medians of "
        f"{result['parameters']['repetitions']} repetitions.",
        "",
    )
    backends = list(result["figures"])
    keys = list(result["figures"][backends[0]])
    page.add(
        *table(
            ["figure", *backends],
            [
                [key, *[num(result["figures"][b][key]["median"], 2) for b in backends]]
                for key in keys
            ],
        )
    )
    worst = max(result["figures"][b]["emit_us_loop_thread"]["median"] for b in backends)
    page.target(
        "event emit on the loop thread",
        f"< {result['target_emit_us']} µs",
        f"{num(worst, 2)} µs",
        worst < result["target_emit_us"],
        "",
    )
