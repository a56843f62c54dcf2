"""A learner's pace (``protocol.pace``) and the adaptive schedule it drives: a slower
learner takes fewer steps per fragment period so that a round's snapshots arrive together,
an equal fleet keeps the fixed schedule, and no step is left out of the accounting."""

from dataclasses import replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.learner import Learner, TakeSnapshot
from gradientmail.protocol.learner_inputs import (
    PublishEnded,
    Stepped,
)
from gradientmail.protocol.pace import SAME_PACE, WINDOW, Pace, fleet_step_time
from gradientmail.protocol.records import RunConfig

ADAPTIVE = RunConfig(fragments=4, sync_every=48, overlap=None)


def timed(pace: Pace, step_time: float, steps: int, start: float = 0.0) -> Pace:
    now = start
    for _ in range(steps):
        now += step_time
        pace, _ = pace.stepped(now)
    return pace


def test_the_step_time_is_a_median_that_one_long_step_does_not_move() -> None:
    pace = timed(Pace(last_at=0.0), 0.5, 10)
    assert pace.step_time == 0.5
    pace, _ = pace.stepped(10.0 + 30.0)  # a 30 s validation pass
    assert pace.step_time == 0.5
    assert len(timed(pace, 0.5, 40).durations) == WINDOW


def test_a_slower_learner_runs_at_its_step_time_over_the_fleets_fastest() -> None:
    slow = timed(Pace(last_at=0.0), 2.0, 5)
    assert slow.rated(0.5, ADAPTIVE).rate == 4.0
    assert slow.rated(2.0 / SAME_PACE, ADAPTIVE).rate == 1.0  # within SAME_PACE: unchanged
    assert slow.rated(0.001, ADAPTIVE).rate == 12.0  # at most a fragment's interval
    paced = RunConfig(fragments=4, sync_every=48, overlap=2)
    assert slow.rated(0.5, paced).rate == 1.0  # the repeatable mode never adapts
    assert slow.rated(None, ADAPTIVE).rate == 1.0


@given(rate=st.floats(1.0, 12.0), steps=st.integers(1, 500))
def test_positions_advance_by_the_rate_without_drift(rate: float, steps: int) -> None:
    pace = Pace(rate=rate)
    total = 0
    for step in range(steps):
        pace, advance = pace.stepped(float(step))
        assert advance >= 1
        total += advance
    # What is left over is the credit, under one position (rounding aside).
    assert -1e-6 <= rate * steps - total < 1.0 + 1e-6


def test_fleet_step_time_ignores_what_is_unknown_or_absurd() -> None:
    assert fleet_step_time([None, 0.5, float("nan"), -1.0, 0.0, 2.0]) == 0.5
    assert fleet_step_time([None]) is None


def fragments_due(learner: Learner, step_time: float, steps: int) -> list[int]:
    """Step ``learner`` ``steps`` times, each ``step_time`` apart, carrying out its
    snapshots at once (published and left unresolved: each fragment goes out once)."""
    out = []
    now = 0.0
    for _ in range(steps):
        now += step_time
        learner, actions = learner.handle(Stepped(1, now))
        for action in actions:
            if isinstance(action, TakeSnapshot):
                learner, _ = learner.took(action.fragment, (torch.ones(1),))
                learner, _ = learner.handle(PublishEnded(action.fragment, action.round, True))
                out.append(action.fragment)
    return out


def test_a_learner_four_times_slower_covers_a_period_in_a_quarter_of_the_steps() -> None:
    zero = (torch.zeros(1),)
    learner = Learner.start(ADAPTIVE, "slow", (0,) * 4, (zero,) * 4, -1)
    slow = replace(learner, pace=Pace(rate=4.0))
    assert fragments_due(slow, 2.0, 12) == [0, 1, 2, 3]
    assert fragments_due(learner, 0.5, 11) == []
    assert fragments_due(learner, 0.5, 48) == [0, 1, 2, 3]
