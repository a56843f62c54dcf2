"""The real-text arms as the page shows them (``bench_text.py``'s results): their order and
labels, the pacing of gradientmail's learners, and the invocations that measured them."""

from typing import Any

import bench_text
from report_convergence import ARM_LABEL


def text_order(arm: str) -> tuple[int, int, str, int]:
    """The arms in the page's order: data-parallel, single, then gradientmail before torchft
    by encoding and H, the kill arms last."""
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


def text_label(arm: str) -> str:
    label = ARM_LABEL.get(arm, arm)
    return label.replace("-kill", " (one learner killed)")


def pacing(overlap: int | None) -> str:
    return "unpaced" if overlap is None else f"overlap {overlap}"


def placement(measured: dict[str, Any]) -> str:
    """Where an invocation's gradientmail arms ran their syncer (``bench_text.SYNCER_IN``)."""
    host = measured.get("syncer_in")
    return (
        "a syncer process of its own" if host is None else f"the syncer in learner {host}'s process"
    )


def invocations(result: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    """The invocations that measured ``result``'s arms (``bench_text.py --keep``), oldest
    first, each with its arms; a run without ``measured`` is the file's header's (one
    without ``syncer_in`` ran its syncer as a process of its own)."""
    header = bench_text.invocation(result)
    found: list[tuple[dict[str, Any], list[str]]] = []
    for arm in sorted(result["figures"]["arms"], key=text_order):
        measured = {"syncer_in": None} | result["figures"]["arms"][arm].get("measured", header)
        for seen, names in found:
            if seen == measured:
                names.append(arm)
                break
        else:
            found.append((measured, [arm]))
    return sorted(found, key=lambda item: str(item[0]["date"]))


_SAID: dict[str, tuple[str, str, str]] = {
    "overlap": (
        "gradientmail's learners ran unpaced in some invocations and paced in others "
        "(`RunConfig.overlap`: listed under the table). ",
        "gradientmail's learners are unpaced (`RunConfig.overlap` None): each applies "
        "a round's version at the first step after it is ready. ",
        "gradientmail's learners apply each round's version {} steps after "
        "their snapshot, waiting for it there if need be (`RunConfig.overlap`). ",
    ),
    "syncer_in": (
        "gradientmail runs the learners as processes on a directory, with the syncer a "
        "process of its own in some invocations and in a learner's process in others "
        "(listed under the table); ",
        "gradientmail runs the learners and a dedicated syncer as processes on a directory; ",
        "gradientmail runs the learners as processes on a directory, learner {}'s "
        "running the syncer node beside its own (no interpreter of its own to start); ",
    ),
}
"""What the page says of an invocation's ``measured`` key across the gradientmail arms:
when the invocations differ, when it is None in all, and its one value (in place of
``{}``)."""


def _alike(result: dict[str, Any], key: str) -> str:
    """One sentence on ``key`` of the invocations that measured ``result``'s gradientmail
    arms (``_SAID``)."""
    mixed, unset, each = _SAID[key]
    values = {
        measured[key]
        for measured, names in invocations(result)
        if any(name.startswith("gm-") for name in names)
    }
    if len(values) > 1:
        return mixed
    value = next(iter(values), None)
    return unset if value is None else each.format(value)


def gm_pacing(result: dict[str, Any]) -> str:
    """What the page says of the gradientmail arms' pacing: one sentence when every
    invocation ran them alike, else a pointer to the invocations' list."""
    return _alike(result, "overlap")


def gm_syncer(result: dict[str, Any]) -> str:
    """What the page says of where the gradientmail arms' syncer ran: one sentence when every
    invocation ran it alike, else a pointer to the invocations' list."""
    return _alike(result, "syncer_in")


def produced(result: dict[str, Any]) -> list[str]:
    """How the size's arms were produced: one invocation, or each of the invocations whose
    runs the file kept."""
    p, figures = result["parameters"], result["figures"]
    found = invocations(result)
    if len(found) == 1:
        return [
            f"Produced by `benchmarks/bench_text.py --size {p['size']} --only "
            f"{' '.join(p['arms'])}` in {figures['total_seconds'] / 60:.1f} minutes (`nox -s "
            "bench-text` runs every arm at the full size).",
            "",
        ]
    lines = [
        f"Measured in {len(found)} invocations of `benchmarks/bench_text.py --size "
        f"{p['size']} --keep --only ...` (each kept the runs of the others; gradientmail ÷ "
        "torchft time ratios only for a pair measured in one invocation, the losses being "
        "the same on any machine):",
        "",
    ]
    for measured, names in found:
        lines.append(
            f"- {measured['date']}, gradientmail {pacing(measured['overlap'])}, "
            f"{placement(measured)}: {', '.join(names)}"
        )
    return [*lines, ""]
