"""The page ``benchmarks/report.py`` writes: its plots, its targets table, and the small
formatters every section uses."""

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

PLOTS = "benchmarks"


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    if not path.exists():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:,.{digits}f}"


def byte_size(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


def spread(entry: dict[str, Any], digits: int = 3, scale: float = 1.0) -> str:
    """``median [min, max]`` of a summary (just the value for one sample)."""
    median = entry["median"] * scale
    if entry["n"] == 1:
        return num(median, digits)
    return (
        f"{num(median, digits)} [{num(entry['min'] * scale, digits)}, "
        f"{num(entry['max'] * scale, digits)}]"
    )


def provenance(result: dict[str, Any]) -> str:
    """Where a section's figures come from: the file, its date, the machine, its load and
    the versions (the page names no commit; the results file keeps it)."""
    machine = result["machine"]
    label = " **quick variant (smoke-test sizes, not the full run)**" if result["quick"] else ""
    load_after = result.get("load_average_1m_after")
    torch = result["versions"].get("torch")
    torch = f", torch {torch}" if torch else ""
    return (
        f"_Source: `benchmarks/results/{result['benchmark']}.json`, {result['date']}, "
        f"{machine['cpus']} CPUs ({machine['processor']}), 1-minute load "
        f"{num(machine['load_average_1m'], 1)} at the start and {num(load_after, 1)} at the "
        f"end, Python {result['versions']['python']}{torch}.{label}_"
    )


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def verdict(met: bool | str | None) -> str:
    """A target's verdict; a string says why it is not judged."""
    if isinstance(met, str):
        return met
    if met is None:
        return "not run"
    return "met" if met else "**missed**"


class Page:
    """The page being written, its plots, and the targets table gathered along the way."""

    def __init__(self, docs: Path) -> None:
        self.docs = docs
        self.lines: list[str] = []
        self.targets: list[list[str]] = []
        (docs / PLOTS).mkdir(parents=True, exist_ok=True)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def plot(self, name: str, draw: Callable[[Any], None], alt: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure = plt.figure(figsize=(8, 4.8), dpi=100)
        try:
            draw(figure)
            figure.tight_layout()
            figure.savefig(self.docs / PLOTS / name, metadata={"Software": None})
        finally:
            plt.close(figure)
        self.add(f"![{alt}]({PLOTS}/{name})", "")

    def target(
        self, what: str, target: str, measured: str, met: bool | str | None, note: str
    ) -> None:
        self.targets.append([what, target, measured, verdict(met), note])
