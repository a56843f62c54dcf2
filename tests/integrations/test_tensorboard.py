"""``gradientmail.events.tensorboard``: a real node writes its scalars, read back from the
event file with TensorBoard's own ``EventAccumulator``."""

import sys
from pathlib import Path

import anyio
import pytest
from node_helpers import CONFIG, FAST, Recorder, tiny_model, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import gradientmail
from gradientmail.events import RoundRecorded, SnapshotPublished
from gradientmail.events import tensorboard as tensorboard_sink
from gradientmail.mailbox import MemoryMailbox

pytestmark = pytest.mark.anyio


async def test_the_scalars_a_person_wants_are_in_the_event_file(tmp_path: Path) -> None:
    log_dir = tmp_path / "runs" / "solo"
    sink = Recorder()
    model = tiny_model()
    async with gradientmail.node(
        model,
        MemoryMailbox(),
        learner="solo",
        config=CONFIG,
        options=FAST,
        sinks=[sink, tensorboard_sink(log_dir, flush_secs=1)],
    ) as node:
        await train(node, model, seed=1, until_round=5)
    events = await anyio.to_thread.run_sync(_reload, log_dir)
    tags = set(events.Tags()["scalars"])
    assert tags >= {f"gradientmail/{t}" for t in ("rounds_committed", "participants", "bytes_up")}
    recorded = [e.record for e in sink.of(RoundRecorded)]  # type: ignore[attr-defined]
    rounds = events.Scalars("gradientmail/rounds_committed")
    assert [(s.step, s.value) for s in rounds] == [(r.round, i + 1) for i, r in enumerate(recorded)]
    participants = events.Scalars("gradientmail/participants")
    assert [(s.step, s.value) for s in participants] == [
        (r.round, len(r.participants)) for r in recorded
    ]
    sizes = [e.size for e in sink.of(SnapshotPublished)]  # type: ignore[attr-defined]
    assert events.Scalars("gradientmail/bytes_up")[-1].value == sum(sizes) > 0
    assert events.Scalars("gradientmail/bytes_down")[-1].value > 0
    behind = events.Scalars("gradientmail/versions_behind")
    assert behind
    assert all(s.value >= 0 for s in behind)
    assert events.Scalars("gradientmail/commit_seconds")


def _reload(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def test_a_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'gradientmail\[tensorboard\]'"):
        tensorboard_sink("unused")
