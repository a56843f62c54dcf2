"""Objects planted by a writer without the run key against the store's read paths: junk at
the record keys ahead, blobs larger than their refs say, snapshots whose parts name blobs
larger than their rows, and snapshots that name blobs garbage collection must keep."""

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from msgspec.structs import replace
from reliability_helpers import CONFIG, FAST, Trainer, history, tiny_model

import gradientmail
from gradientmail import cli
from gradientmail.clock import MonotonicClock
from gradientmail.errors import CorruptBlob
from gradientmail.mailbox import LocalMailbox, Mailbox
from gradientmail.mailbox import open as open_mailbox
from gradientmail.protocol import keys, records
from gradientmail.protocol.checkpoint import retained
from gradientmail.protocol.records import BlobRef, Snapshot, SnapshotPart
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import RunReader
from gradientmail.store import Store, sha256

pytestmark = pytest.mark.anyio


async def test_junk_at_record_keys_ahead_costs_a_bounded_number_of_reads_per_poll(
    tmp_path: Path,
) -> None:
    box = LocalMailbox(tmp_path)
    model = tiny_model()
    config = replace(CONFIG, grace=0.05)
    async with gradientmail.node(model, box, learner="a", config=config, options=FAST) as node:
        trainer = Trainer(model, seed=1)
        for round in range(5, 1005):
            await box.put_if_absent(keys.record(round), b"{}")
        clock = MonotonicClock()
        with anyio.fail_after(60):
            while node.state.round < 2:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.002)
            before, start = node.state.requests["get"], clock.now()
            while clock.now() - start < 2.0:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.01)
            gets = node.state.requests["get"] - before
        polls = (clock.now() - start) / FAST.poll_interval
        # Each poll reads its new objects (snapshots, claims, records of the rounds it moves
        # through), never the planted ones again.
        assert gets < 20 * polls, (gets, polls)
    assert len(await history(box)) >= 3


MIB = 1 << 20


async def _oversized_blob_is_refused_unread(box: Mailbox) -> None:
    store = Store(box, attempts=3)
    data = os.urandom(8 * MIB)
    await box.put_if_absent(keys.blob(sha256(data)), data)
    ref = BlobRef(sha256=sha256(data), size=1000, encoding="fp32")
    with pytest.raises(
        CorruptBlob, match=r"holds \d+ bytes or more, but its reference declares 1000"
    ):
        await store.get_blob(ref)
    assert store.stats.bytes_down <= 1000
    with pytest.raises(CorruptBlob, match=keys.blob(ref.sha256)):
        await store.blob_ranges(ref, [(0, 10)])
    assert store.stats.bytes_down <= 2000
    # A ref declaring more than a blob of its fragment can take is not read at all.
    huge = BlobRef(sha256=ref.sha256, size=1 << 40, encoding="fp32")
    gets = store.stats.requests["get"]
    with pytest.raises(CorruptBlob, match=f"declares {1 << 40} bytes, more than the 4096"):
        await store.get_blob(huge, most=4096)
    assert store.stats.requests["get"] == gets


async def test_a_blob_larger_than_its_ref_is_refused_unread_in_a_directory(tmp_path: Path) -> None:
    await _oversized_blob_is_refused_unread(LocalMailbox(tmp_path))


async def test_a_blob_larger_than_its_ref_is_refused_unread_over_s3(
    moto_server: str, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run?endpoint_url={moto_server}&region=us-east-1"
    async with open_mailbox(url) as box:
        await _oversized_blob_is_refused_unread(box)


async def _run_with_planted(
    tmp_path: Path, plant: Callable[[LocalMailbox, gradientmail.Node], Awaitable[None]]
) -> tuple[list[records.RoundRecord], int]:
    box = LocalMailbox(tmp_path)
    model = tiny_model()
    async with gradientmail.node(model, box, learner="a", config=CONFIG, options=FAST) as node:
        await plant(box, node)
        trainer = Trainer(model, seed=1)
        with anyio.fail_after(60):
            while node.state.round < 5:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.002)
        downloaded = node.state.bytes_downloaded
    return await history(box), downloaded


def _forged(round: int, **delta: object) -> bytes:
    snapshot = Snapshot(
        learner="mallory",
        round=round,
        fragment=round % CONFIG.fragments,
        base_version=0,
        steps=1,
        tokens=16,
        norm=1.0,
        **delta,  # type: ignore[arg-type]
    )
    return records.encode(snapshot)


async def test_a_snapshot_naming_a_blob_larger_than_its_ref_is_rejected_unread(
    tmp_path: Path,
) -> None:
    big = b"\0" * (32 * MIB)
    ref = BlobRef(sha256=sha256(big), size=512, encoding="fp32")

    async def plant(box: LocalMailbox, node: gradientmail.Node) -> None:
        await box.put_if_absent(keys.blob(ref.sha256), big)
        for round in range(1, 5):
            await box.put_if_absent(keys.snapshot(round, "mallory"), _forged(round, delta=ref))

    found, downloaded = await _run_with_planted(tmp_path, plant)
    assert downloaded < 4 * MIB
    rejected = [r for record in found for r in record.rejected if r.learner == "mallory"]
    assert rejected
    assert all(r.reason == "corrupt" for r in rejected), rejected
    assert "declares 512" in rejected[0].detail


async def test_parts_larger_than_their_rows_are_rejected_before_any_is_read(
    tmp_path: Path,
) -> None:
    blob = os.urandom(MIB)
    ref = BlobRef(sha256=sha256(blob), size=MIB, encoding="fp32")

    async def plant(box: LocalMailbox, node: gradientmail.Node) -> None:
        await box.put_if_absent(keys.blob(ref.sha256), blob)
        for round in range(1, 5):
            spec = node.manifest.fragments[round % CONFIG.fragments]
            rows = [(0, p.shape[0] if p.shape else 1) for p in spec.params]
            empty = [(end, end) for _, end in rows]
            parts = [SnapshotPart(delta=ref, rows=tuple(rows))]
            parts += [SnapshotPart(delta=ref, rows=tuple(empty))] * 63
            await box.put_if_absent(
                keys.snapshot(round, "mallory"), _forged(round, parts=tuple(parts))
            )

    found, downloaded = await _run_with_planted(tmp_path, plant)
    assert downloaded < 4 * MIB
    rejected = [r for record in found for r in record.rejected if r.learner == "mallory"]
    assert rejected
    assert all(r.reason == "shape" for r in rejected), rejected


async def test_unverified_snapshots_naming_retained_blobs_delete_nothing_replay_needs(
    tmp_path: Path,
) -> None:
    """A signed run; a fresh node takes over, and the attacker (no key) has planted unsigned
    snapshots in the rounds its first commit collects, each naming the other fragment's
    newest checkpoint θ and momentum. While they are retained their blobs stay, and every
    retained version replays."""
    box = LocalMailbox(tmp_path)
    config = replace(CONFIG, keep_rounds=2, keep_versions=8, checkpoint_every=2)
    secret = "the run secret, long enough"
    key = RunKey(secret)
    await _train(box, config, secret, until_round=8)
    before = await history(box, key)
    last = before[-1].round
    newest = {r.fragment: r for r in before if r.theta is not None}
    # The rounds the next commits collect, each naming the other fragment's checkpoint.
    collected = set().union(
        *(
            retained(r, config).snapshots - retained(r + 1, config).snapshots
            for r in range(last, last + 4)
        )
    )
    for round in collected:
        checkpoint = newest[1 - round % 2]
        refs = (checkpoint.theta, checkpoint.outer)
        planted = tuple(SnapshotPart(delta=ref, rows=()) for ref in refs if ref is not None)
        await box.put_if_absent(keys.snapshot(round, "mallory"), _forged(round, parts=planted))
    await _train(box, config, secret, until_round=last + 3)
    found = await history(box, key)
    last = found[-1].round
    assert {r.round for r in newest.values()} <= retained(last, config).records, last
    for record in found:
        if record.round in retained(last, config).records:
            for ref in (record.update, record.theta, record.outer):
                if ref is not None:
                    assert await box.get(keys.blob(ref.sha256)) is not None, record.round
    replayer = RunReader.of(box, run_key=key)
    for record in found[-config.fragments :]:
        rebuilt = await replayer.rebuild(record.fragment, record.version, momentum=True)
        assert rebuilt is not None, record.round


async def _train(box: Mailbox, config: records.RunConfig, secret: str, until_round: int) -> None:
    model = tiny_model()
    async with gradientmail.node(
        model, box, learner="a", config=config, options=FAST, run_key=secret
    ) as node:
        trainer = Trainer(model, seed=1)
        with anyio.fail_after(60):
            while node.state.round < until_round:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.002)


async def test_a_joiner_whose_blob_is_gone_fails_after_five_listings(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path)
    config = replace(CONFIG, checkpoint_every=1)
    model = tiny_model()
    async with gradientmail.node(model, box, learner="a", config=config, options=FAST) as node:
        trainer = Trainer(model, seed=1)
        with anyio.fail_after(30):
            while node.state.round < 3:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.002)
    newest = (await history(box))[-1]
    assert newest.theta is not None
    await box.delete([keys.blob(newest.theta.sha256)])
    # Five listings a poll interval apart, and the time to read: far under the deadline.
    with anyio.fail_after(10), pytest.raises(CorruptBlob, match="showed no newer record"):
        async with gradientmail.node(tiny_model(), box, learner="b", config=config, options=FAST):
            pass


async def test_export_and_load_refuse_an_oversized_theta0_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    box = LocalMailbox(tmp_path)
    async with gradientmail.node(tiny_model(), box, learner="a", config=CONFIG, options=FAST):
        pass
    manifest = await Store(box).manifest()
    assert manifest is not None
    ref = manifest.theta0[0]
    key = keys.blob(ref.sha256)
    await box.delete([key])
    await box.put_if_absent(key, b"\0" * (16 * MIB))
    with pytest.raises(CorruptBlob, match=f"{key} holds 16777216 bytes or more.*declares"):
        await gradientmail.load(box, tiny_model())
    out = tmp_path / "model.safetensors"
    # The command line in this process (in a thread: it runs its own event loop); an error it
    # does not expect propagates from ``main``.
    argv = ["export", str(tmp_path), "--out", str(out)]
    status = await anyio.to_thread.run_sync(cli.main, argv)
    stderr = capsys.readouterr().err
    assert status == 1, stderr
    assert f"declares {ref.size}" in stderr


async def _junk_records_are_judged_once(box: Mailbox, count: int) -> None:
    store = Store(box)
    async with anyio.create_task_group() as tg:
        for round in range(count):
            tg.start_soon(box.put_if_absent, keys.record(round), b"{}")
    assert await store.record_rounds() == []
    before = store.stats.requests
    for _ in range(3):
        assert await store.record_rounds() == []
    after = store.stats.requests
    assert after["get"] - before["get"] == 0
    assert after["list"] - before["list"] == 3


async def test_junk_records_cost_one_listing_a_poll_in_a_directory(tmp_path: Path) -> None:
    await _junk_records_are_judged_once(LocalMailbox(tmp_path), 1000)


async def test_junk_records_cost_one_listing_a_poll_over_s3(
    moto_server: str, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run?endpoint_url={moto_server}&region=us-east-1"
    async with open_mailbox(url) as box:
        await _junk_records_are_judged_once(box, 50)
