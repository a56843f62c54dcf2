"""The blocking facade (``gradientmail.sync.node``) under both event loops, on a real
directory: training from a plain loop, the flush, events, failures and interrupts."""

import concurrent.futures
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_helpers import CONFIG, FAST, Recorder, Trainer, tiny_model
from sync_support import (
    SOLO,
    BreakingMailbox,
    check_holds_committed,
    committed,
    leases,
    wait_for,
)

import gradientmail
import gradientmail.sync
from gradientmail.errors import NodeFailed, RunMismatch
from gradientmail.events import (
    Closed,
    Closing,
    Event,
    FragmentAligned,
    Joined,
    LeaseReleased,
    StepsDropped,
)

pytestmark = pytest.mark.parametrize("backend", ["asyncio", "trio"])


def _threads() -> set[threading.Thread]:
    """This process's threads but trio's idle workers (a process-wide cache of trio's that
    outlives any one event loop by design). AnyIO's asyncio workers end shortly after their
    loop, so callers wait for the set to shrink back."""
    return {t for t in threading.enumerate() if not t.name.startswith("Trio thread")}


def _train_until(node: gradientmail.sync.Node, trainer: Trainer, round: int) -> None:
    wait_for(lambda: _one_step(node, trainer) >= round)


def _one_step(node: gradientmail.sync.Node, trainer: Trainer) -> int:
    trainer.step()
    node.step(tokens=16)
    return node.state.round


def test_a_plain_loop_trains_and_leaving_the_block_flushes(backend: str, tmp_path: Path) -> None:
    sink = Recorder()
    model = tiny_model()
    threads_before = _threads()
    with gradientmail.sync.node(
        model,
        str(tmp_path),
        **SOLO,
        sinks=[sink],
        backend=backend,
    ) as node:
        _train_until(node, Trainer(model, seed=1), round=3)
        steps = node.state.steps
        assert leases(tmp_path) == {"solo": (pytest.approx(1, abs=10**9), "learner")}
    state = node.state
    assert state.steps == steps > 0
    assert state.rounds_committed >= 3
    assert [e for e in sink.events if isinstance(e, Closing)] == [Closing("solo", flushing=True)]
    assert sink.of(Closed)
    assert not sink.of(StepsDropped)
    assert leases(tmp_path) == {}
    assert len(committed(tmp_path)) >= 4
    check_holds_committed(tmp_path, model, state.versions)
    wait_for(lambda: _threads() <= threads_before, limit=10)
    with pytest.raises(RuntimeError, match="closed: step"):
        node.step(tokens=16)


def test_events_iterate_in_another_thread_until_the_node_closes(
    backend: str, tmp_path: Path
) -> None:
    model = tiny_model()
    seen: list[Event] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with gradientmail.sync.node(model, str(tmp_path), **SOLO, backend=backend) as node:
            events = node.events()
            watcher = pool.submit(lambda: seen.extend(events))
            _train_until(node, Trainer(model, seed=1), round=2)
        watcher.result(timeout=30)
    aligned = [e for e in seen if isinstance(e, FragmentAligned)]
    assert aligned, "no FragmentAligned reached the blocking iterator"
    assert not any(isinstance(e, Joined) for e in seen), "events before the subscription"
    assert any(isinstance(e, Closed) for e in seen)
    assert isinstance(seen[-1], LeaseReleased), "the iteration ended before the node closed"


def test_an_iterator_that_reads_only_after_the_close_still_gets_every_event(
    backend: str, tmp_path: Path
) -> None:
    """The reader starts once the node has emitted its last event (a sink sees
    ``LeaseReleased``): leaving the block waits for it to read what its stream holds, so it
    gets the close's events too, instead of the portal stopping under it."""
    model = tiny_model()
    seen: list[Event] = []
    released = threading.Event()

    def sink(event: Event) -> None:
        if isinstance(event, LeaseReleased):
            released.set()

    def read_after_the_close(events: Iterator[Event]) -> None:
        assert released.wait(timeout=30), "the node never released its lease"
        seen.extend(events)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with gradientmail.sync.node(
            model,
            str(tmp_path),
            **SOLO,
            sinks=[sink],
            backend=backend,
        ) as node:
            watcher = pool.submit(read_after_the_close, node.events())
            _train_until(node, Trainer(model, seed=1), round=2)
        watcher.result(timeout=30)
    assert any(isinstance(e, Closed) for e in seen), [type(e).__name__ for e in seen[-5:]]
    assert isinstance(seen[-1], LeaseReleased)


def test_a_broken_store_raises_from_step_and_from_leaving(backend: str, tmp_path: Path) -> None:
    box = BreakingMailbox(tmp_path)
    model = tiny_model()
    trainer = Trainer(model, seed=1)

    def failing() -> bool:
        try:
            _one_step(node, trainer)
        except NodeFailed:
            return True
        return False

    with (  # noqa: PT012
        pytest.raises(NodeFailed) as left,
        gradientmail.sync.node(model, box, **SOLO, backend=backend) as node,
    ):
        _train_until(node, trainer, round=1)
        box.broken = True
        wait_for(failing)
        with pytest.raises(NodeFailed) as stepped:
            node.step(tokens=16)
        assert isinstance(stepped.value.__cause__, OSError)
    assert isinstance(left.value.__cause__, OSError)
    assert "is gone" in str(left.value)
    assert leases(tmp_path) == {}


@pytest.mark.parametrize(
    ("error", "reason"),
    [(ZeroDivisionError, "closed by an exception"), (KeyboardInterrupt, "cancelled")],
)
def test_an_exception_or_ctrl_c_in_the_block_closes_without_flush(
    backend: str, error: type[BaseException], reason: str, tmp_path: Path
) -> None:
    """A KeyboardInterrupt raised in the training thread is what Ctrl-C raises there."""
    sink = Recorder()
    model = tiny_model()
    with (  # noqa: PT012
        pytest.raises(error),
        gradientmail.sync.node(
            model,
            str(tmp_path),
            **SOLO,
            sinks=[sink],
            backend=backend,
        ) as node,
    ):
        trainer = Trainer(model, seed=1)
        for _ in range(CONFIG.sync_every + 1):
            _one_step(node, trainer)
        raise error
    assert sink.of(Closing) == [Closing("solo", flushing=False)]
    dropped = sink.of(StepsDropped)
    assert any(e.detail == reason for e in dropped)  # type: ignore[attr-defined]
    assert all(e.reason == "closed-without-flush" for e in dropped)  # type: ignore[attr-defined]
    assert leases(tmp_path) == {}


def test_a_join_that_fails_raises_from_entering(backend: str, tmp_path: Path) -> None:
    with gradientmail.sync.node(
        tiny_model(), str(tmp_path), learner="a", config=CONFIG, options=FAST, backend=backend
    ):
        pass
    threads_before = _threads()
    with (
        pytest.raises(RunMismatch),
        gradientmail.sync.node(
            tiny_model(hidden=3), str(tmp_path), learner="b", options=FAST, backend=backend
        ),
    ):
        pytest.fail("entered a run whose model differs")
    wait_for(lambda: _threads() <= threads_before, limit=10)
    assert leases(tmp_path) == {}


def test_bad_arguments_name_what_was_wrong(backend: str, tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match="backend must be 'asyncio' or 'trio', got 'curio'"),
        gradientmail.sync.node(tiny_model(), str(tmp_path), learner="a", backend="curio"),  # type: ignore[arg-type]
    ):
        pass
    with (
        pytest.raises(ValueError, match="main thread"),
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        pool.submit(
            lambda: gradientmail.sync.node(
                tiny_model(), str(tmp_path), learner="a", backend=backend, handle_signals=True
            ).__enter__()
        ).result()


def test_two_nodes_declaring_one_shard_are_warned(backend: str, tmp_path: Path) -> None:
    with (
        gradientmail.sync.node(
            tiny_model(),
            str(tmp_path),
            learner="host-0",
            config=CONFIG,
            options=FAST,
            backend=backend,
        ) as first,
        gradientmail.sync.node(
            tiny_model(), str(tmp_path), learner="host-1", options=FAST, backend=backend
        ) as second,
    ):
        shard = gradientmail.patterns.shard_of("host-0", count=2)
        assert first.declare_shard(shard) == shard
        assert second.declare_shard(gradientmail.patterns.shard_of("host-1", count=2))
        with pytest.warns(gradientmail.patterns.ShardOverlap, match=r"'host-0' \(shard 0 of 2\)"):
            second.declare_shard(shard, name="data")


def test_signal_handlers_last_as_long_as_the_block(backend: str, tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with gradientmail.sync.node(
        tiny_model(),
        str(tmp_path),
        learner="a",
        options=FAST,
        backend=backend,
        handle_signals=True,
    ):
        during = {s: signal.getsignal(s) for s in before}
        assert all(during[s] is not before[s] for s in before)
    assert {s: signal.getsignal(s) for s in before} == before
