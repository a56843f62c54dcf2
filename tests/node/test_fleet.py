"""A fleet of unequal machines (the adaptive schedule, ``RunConfig.overlap`` None): the fast
learners do not wait for a slow one, and the slow one's steps still reach the rounds.

Three learners on one mailbox, each step a ``TICK`` of simulated compute (a sleep), the
third four times as long. With the default, the fast learners wait on rounds for at most
``MAX_WAITING`` of their time, the slow learner takes part in the rounds with the steps it
has (its schedule runs four positions a step), and none of its steps is dropped. The same
fleet in the repeatable mode is the control: there every learner runs at the pace of the
slowest, the fast ones spend most of their time waiting, and they report it (``Waiting``,
naming the slow one). A learner that pauses holds the others' rounds once, for a bounded
time.
"""

import statistics
from collections.abc import Awaitable, Callable

import anyio
import pytest
from node_helpers import (
    FAST,
    Recorder,
    Trainer,
    assert_holds_committed,
    assert_steps_accounted,
    records,
    tiny_model,
)

from gradientmail._node import Node
from gradientmail._node import node as open_node
from gradientmail.events import (
    WAITING_WARNING,
    Closed,
    Event,
    GaveUp,
    RoundRecorded,
    StepsDropped,
    Waiting,
)
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol.records import RoundRecord, RunConfig

pytestmark = [pytest.mark.anyio, pytest.mark.timing]

TICK = 0.02
SPEEDS = {"a": 1, "b": 1, "c": 4}
TRAIN = 4.0
"""Seconds each learner trains."""
MAX_WAITING = 0.05
PAUSED = 2.0
CONFIG = RunConfig(fragments=2, sync_every=16, grace=0.3)
SPACED = RunConfig(fragments=2, sync_every=64, grace=0.2, keep_versions=1000, keep_rounds=1000)


async def run_fleet(
    config: RunConfig,
    sink: Callable[[Event], None],
    train: Callable[[str, Node, Trainer], Awaitable[None]],
) -> MemoryMailbox:
    """Learners a, b and c on one mailbox (a creates the run, b and c join it), each running
    ``train(name, node, trainer)`` once all three have joined; the mailbox after they closed."""
    box = MemoryMailbox()
    created, everyone = anyio.Event(), anyio.Event()
    joined: set[str] = set()

    async def learner(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(
            model, box, learner=name, config=config, options=FAST, sinks=[sink]
        ) as node:
            created.set()
            joined.add(name)
            if joined == set(SPEEDS):
                everyone.set()
            await everyone.wait()
            await train(name, node, Trainer(model, seed))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner, "a", 1)
            await created.wait()
            tg.start_soon(learner, "b", 2)
            tg.start_soon(learner, "c", 3)
    return box


async def fleet(
    config: RunConfig,
) -> tuple[dict[str, float], dict[str, int], list[Waiting], list[RoundRecord]]:
    """Every learner trains ``TRAIN`` seconds at its speed, then closes. Returns each one's
    share of its training time spent waiting, the steps each dropped, the ``Waiting``
    reports and the records."""
    waiting: dict[str, float] = {}
    dropped = dict.fromkeys(SPEEDS, 0)
    reports: list[Waiting] = []

    def seen(event: Event) -> None:
        if isinstance(event, StepsDropped):
            dropped[event.learner] += event.steps
        if isinstance(event, Waiting):
            reports.append(event)

    async def train(name: str, node: Node, trainer: Trainer) -> None:
        began = anyio.current_time()
        while anyio.current_time() - began < TRAIN:
            trainer.step()
            await node.step(tokens=16)
            await anyio.sleep(SPEEDS[name] * TICK)
        waiting[name] = node.state.waited_seconds / (anyio.current_time() - began)

    box = await run_fleet(config, seen, train)
    return waiting, dropped, reports, await records(box)


async def test_the_fast_learners_of_an_unequal_fleet_do_not_wait_for_the_slow_one() -> None:
    waiting, dropped, reports, history = await fleet(CONFIG)
    assert reports == []
    assert waiting["a"] <= MAX_WAITING
    assert waiting["b"] <= MAX_WAITING
    assert dropped == dict.fromkeys(SPEEDS, 0)
    with_c = [r for r in history if "c" in {p.learner for p in r.participants}]
    # Four times slower, c covers a period in a quarter of the steps: it is in most rounds.
    assert len(with_c) >= len(history) // 2, [
        sorted(p.learner for p in r.participants) for r in history
    ]
    steps: dict[str, list[int]] = {}
    for r in with_c:
        for p in r.participants:
            steps.setdefault(p.learner, []).append(p.steps)
    assert statistics.median(steps["c"]) < statistics.median(steps["a"])


async def test_the_repeatable_mode_paces_every_learner_at_the_slowest() -> None:
    waiting, dropped, reports, _ = await fleet(
        RunConfig.repeatable(fragments=2, sync_every=16, grace=0.3)
    )
    assert waiting["a"] > 0.3
    assert dropped == dict.fromkeys(SPEEDS, 0)
    # The fast learners say so, and whom they wait for.
    assert {"a", "b"} <= {w.learner for w in reports}
    assert all(w.share > WAITING_WARNING for w in reports)
    assert any(w.waiting_for == ("c",) for w in reports if w.learner == "a")


async def test_a_pausing_learner_holds_the_others_rounds_at_most_once_for_its_patience() -> None:
    """c stops stepping for ``PAUSED`` seconds (a validation pass) while a and b train on:
    one round waits for it, at most the grace plus its step time, and then the rounds go on
    without it, a fragment's interval apart; once it steps again it is in them again. (In
    the repeatable mode no round commits during the pause.)"""
    seen_by_a: list[tuple[float, RoundRecord]] = []
    pause: list[float] = []
    # a and b train on until c has taken its 200 steps, so rounds after c's pause have
    # learners to close them with c whatever the load does to the step times.
    c_done = anyio.Event()

    def seen(event: Event) -> None:
        if isinstance(event, RoundRecorded) and event.learner == "a":
            seen_by_a.append((anyio.current_time(), event.record))

    async def train(name: str, node: Node, trainer: Trainer) -> None:
        step = 0
        while step < 200 or (name != "c" and not c_done.is_set()):
            trainer.step()
            await node.step(tokens=16)
            await anyio.sleep(TICK)
            if name == "c" and step == 80:
                pause.append(anyio.current_time())
                await anyio.sleep(PAUSED)
                pause.append(anyio.current_time())
            step += 1
        if name == "c":
            c_done.set()

    await run_fleet(CONFIG, seen, train)
    began, ended = pause
    during = [r for at, r in seen_by_a if began < at < ended]
    interval = CONFIG.sync_every // CONFIG.fragments * TICK
    # Each round of the pause a fragment's interval apart (step times stretched by load),
    # one of them held up to the patience: far from one round for the whole pause.
    assert len(during) >= (PAUSED - CONFIG.grace) / (4 * interval), len(during)
    assert sum("c" in {p.learner for p in r.participants} for r in during) <= 1
    after = [r for at, r in seen_by_a if at > ended + 1.0]
    assert any("c" in {p.learner for p in r.participants} for r in after)


async def test_a_learner_that_stands_still_while_the_others_close_ends_on_their_model() -> None:
    """c stands still after its 60th step for ``PAUSED`` seconds while a and b train on
    for many cycles of rounds and close: when c closes, its model lacks those rounds, so it
    drops its unsent steps (``StepsDropped``, ``behind``), makes no round of its own (a
    round of its stale steps alone would be the run's last, at full weight) and ends on
    their θ, a committed one newer than it held; every one of its steps is in a round or in
    a drop report."""
    recorder = Recorder()
    nodes: dict[str, tuple[Node, Trainer]] = {}
    paused = anyio.Event()
    paused_at: list[tuple[int, tuple[int, ...]]] = []

    async def train(name: str, node: Node, trainer: Trainer) -> None:
        nodes[name] = (node, trainer)
        step = 0
        while step < 60 if name == "c" else not paused.is_set():
            trainer.step()
            await node.step(tokens=16)
            await anyio.sleep(TICK)
            step += 1
        if name == "c":
            paused_at.append((node.state.round, node.state.versions))
            paused.set()
            await anyio.sleep(PAUSED)
            return
        with anyio.fail_after(10):
            # A cycle of rounds is 2 × 8 steps: a and b go on for more than two.
            while node.state.round < paused_at[0][0] + 3 * CONFIG.fragments:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(TICK)

    # Every version kept: the end checks c's weights against the θ of the version it holds.
    kept = RunConfig(fragments=2, sync_every=16, grace=0.3, keep_versions=1000, keep_rounds=1000)
    box = await run_fleet(kept, recorder, train)
    history = await records(box)
    dropped = [e for e in recorder.of(StepsDropped) if e.learner == "c"]
    assert dropped
    assert {e.reason for e in dropped} == {"behind"}, dropped
    assert_steps_accounted("c", 60, 60 * 16, recorder.events, history)
    with_c = [r.round for r in history if "c" in {p.learner for p in r.participants}]
    assert max(with_c) < history[-1].round - 2 * CONFIG.fragments, (with_c, len(history))
    node, trainer = nodes["c"]
    _, held = paused_at[0]
    assert all(after > before for after, before in zip(node.state.versions, held, strict=True))
    await assert_holds_committed(box, trainer.model, node.state.versions)


async def test_a_learner_that_closes_early_closes_no_round_alone() -> None:
    """c closes while a and b train on (a smaller share of the data, say): its flush
    snapshots go out at once, one a fragment's interval ahead of the rounds' pace. The
    rounds that hold them wait for a and b from when the pace expects them, so none of c's
    closing rounds is c's alone, and c ends on a θ that a's and b's steps are in."""
    recorder = Recorder()
    closed = anyio.Event()
    nodes: dict[str, tuple[Node, Trainer]] = {}

    def seen(event: Event) -> None:
        recorder(event)
        if isinstance(event, Closed) and event.learner == "c":
            closed.set()

    async def train(name: str, node: Node, trainer: Trainer) -> None:
        nodes[name] = (node, trainer)
        step = 0
        while step < 3 * SPACED.sync_every if name == "c" else not closed.is_set():
            trainer.step()
            await node.step(tokens=16)
            await anyio.sleep(TICK)
            step += 1

    # A fragment's rounds are 32 steps apart, several times the patience (grace and a step).
    box = await run_fleet(SPACED, seen, train)
    history = await records(box)
    closing = [r for r in history if any(p.learner == "c" and p.closing for p in r.participants)]
    assert closing
    alone = [r.round for r in closing if {p.learner for p in r.participants} == {"c"}]
    assert alone == [], [sorted(p.learner for p in r.participants) for r in closing]
    assert recorder.of(GaveUp) == []
    node, trainer = nodes["c"]
    await assert_holds_committed(box, trainer.model, node.state.versions)
