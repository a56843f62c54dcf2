"""A demo learner in this process: a real node on a real directory, trained on a text file."""

import json
from pathlib import Path

import anyio
import pytest
from rich.console import Console

from gradientmail.demo.runner import _prepare, _Session
from gradientmail.demo.settings import DemoSettings, corpus, read_progress
from gradientmail.demo.worker import train
from gradientmail.errors import UsageError
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import Manifest, decode


async def _manifest_and_rounds(store: Path) -> tuple[Manifest, int]:
    async with LocalMailbox(store) as mailbox:
        data = await mailbox.get(keys.MANIFEST)
        assert data is not None
        return decode(data, Manifest), len(await mailbox.list(keys.RECORDS))


def test_a_learner_trains_on_a_text_file_and_reports_its_progress(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    store = tmp_path / "store"
    settings = DemoSettings(
        store=str(store), workdir=str(store), learners=1, steps=8, batch_size=4, context=16,
        fragments=2, sync_every=4, data=str(text), model="tiny", live=False, backend="trio",
    )  # fmt: skip
    assert corpus(settings).vocab_size == 256
    assert corpus(settings).floor is None
    _prepare(settings)
    assert anyio.run(train, settings, 0, backend="trio") == "done"
    progress = read_progress(store, "learner-0")
    assert progress is not None
    assert progress.phase == "done"
    assert progress.step == 8
    assert progress.tokens == 8 * 4 * 16
    assert progress.loss is not None
    assert progress.state is not None
    assert progress.state["bytes_published"] > 0
    manifest, rounds = anyio.run(_manifest_and_rounds, store)
    assert manifest.created_by == "learner-0"
    shapes = {p.name: p.shape for spec in manifest.fragments for p in spec.params}
    assert shapes["tok_emb.weight"] == (256, 32)
    assert rounds >= 4
    events = (store / "events" / "learner-0.jsonl").read_text().splitlines()
    assert json.loads(events[0])["event"] in ("creating_run", "joined")


def test_a_text_file_too_short_for_its_shards_is_refused_by_the_runner(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("tiny" * 20)
    settings = DemoSettings(store="x", workdir="x", learners=3, context=16, data=str(text))
    with pytest.raises(UsageError, match=r"--data .*short.txt: .*fewer than one sequence"):
        _Session(settings, Console())
