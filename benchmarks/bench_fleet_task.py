"""The fleets of ``bench_fleet.py``: each learner's speed, the steps it takes at that speed
in the wall-clock budget (its compute, then a sleep), its pauses, and the learning rate's
schedule over the budget."""

import time
from collections.abc import Callable

import bench_convergence_task as convergence

SIZE = "medium"
BASE_STEP = 0.1
"""Seconds per step of a speed-1 learner (the medium model's compute is about a third)."""
SYNC_EVERY = 50
CURVE_EVERY = 10.0
"""Seconds between two validation losses of a learner's model while it trains."""
BUDGET = 120.0
PAUSE = 15.0
PAUSE_EVERY = 250
FLEETS: dict[str, list[float]] = {
    "equal": [1.0, 1.0, 1.0, 1.0],
    "mixed": [1.0, 1.5, 2.0, 3.0],
    "straggler": [1.0, 1.0, 1.0, 4.0],
    "pausing": [1.0, 1.0, 1.0, 1.0],
    "equal-H100": [1.0, 1.0, 1.0, 1.0],
    "equal-H250": [1.0, 1.0, 1.0, 1.0],
    "equal-steps": [1.0, 1.0, 1.0, 1.0],
}


def matched(fleet: str) -> list[float]:
    """An equal fleet of ``fleet``'s size that takes as many steps in ``BUDGET``: every
    learner at the harmonic mean of its speeds, or for ``pausing`` at the speed that takes
    what its learners take alone, the pauses included (``X-matched``: the reference a fleet
    of unequal machines is held to)."""
    speeds = FLEETS[fleet]
    if fleet != "pausing":
        return [len(speeds) / sum(1 / s for s in speeds)] * len(speeds)
    last = len(speeds) - 1
    steps = sum(alone_steps(s, BUDGET, pauses=k == last) for k, s in enumerate(speeds))
    return [len(speeds) * BUDGET / (BASE_STEP * steps)] * len(speeds)


def sync_every(fleet: str) -> int:
    """The fleet's H: ``SYNC_EVERY`` unless its name ends in ``-H<steps>``."""
    _, marked, steps = fleet.rpartition("-H")
    return int(steps) if marked and steps.isdigit() else SYNC_EVERY


def lr_scale(started: float, budget: float) -> float:
    """The learning rate's factor at this moment of the budget (``lr_at``'s schedule)."""
    return _scale((time.monotonic() - started) / budget)


def by_steps(fleet: str) -> bool:
    """Whether ``fleet``'s learning rate follows each learner's step count instead of the
    clock (a name ending in ``-steps``): the same schedule over the steps the learner takes
    alone in the budget (``step_scale``), so that two systems' learners that take the same
    steps run the same rates whatever their timing."""
    return fleet.endswith("-steps")


def step_scale(step: int, steps: int) -> float:
    """The learning rate's factor at step ``step`` of ``steps`` (``lr_scale``'s schedule
    over steps)."""
    return _scale(step / steps)


def _scale(fraction: float) -> float:
    return convergence.lr_at(int(min(1.0, fraction) * 1000), 1000) / convergence.LR


def timed_steps(
    step: Callable[[], None],
    *,
    speed: float,
    budget: float,
    started: float,
    pauses: bool,
    after_step: Callable[[], None],
    probe: Callable[[], float],
) -> tuple[int, float, list[list[float]]]:
    """Run ``step`` at ``speed × BASE_STEP`` seconds a step until ``budget`` seconds after
    ``started``; with ``pauses`` a pause of ``PAUSE`` seconds every ``PAUSE_EVERY`` steps.
    Returns the steps taken, the seconds steps overran their time (a peer system's blocking
    sync, the node's own work) and ``probe()`` (a validation loss) every ``CURVE_EVERY``
    seconds, as ``[seconds, loss]`` pairs."""
    steps, overrun = 0, 0.0
    curve: list[list[float]] = []
    while (elapsed := time.monotonic() - started) < budget:
        if elapsed >= len(curve) * CURVE_EVERY:
            curve.append([elapsed, probe()])
        began = time.monotonic()
        step()
        after_step()
        steps += 1
        left = speed * BASE_STEP - (time.monotonic() - began)
        overrun += max(0.0, -left)
        if pauses and steps % PAUSE_EVERY == 0:
            left += PAUSE
        if left > 0:
            time.sleep(left)
    return steps, overrun, curve


def alone_steps(
    speed: float,
    budget: float,
    *,
    pauses: bool,
    base_step: float = BASE_STEP,
    pause: tuple[float, int] = (PAUSE, PAUSE_EVERY),
) -> int:
    """The steps a learner of ``speed`` takes alone in ``budget`` seconds at ``base_step``
    seconds a step of speed 1, its pauses (``pause``: seconds, every so many steps)
    included."""
    seconds, every = pause
    steps, elapsed = 0, 0.0
    while elapsed < budget:
        steps += 1
        elapsed += speed * base_step + (seconds if pauses and steps % every == 0 else 0.0)
    return steps


for _name in ("mixed", "straggler", "pausing"):
    FLEETS[f"{_name}-matched"] = matched(_name)
