"""The syncer against objects someone else put into the bucket.

Each test plays one attack that would stop or steer an unguarded syncer: a claim numbered at the
top of its range, beats planted under a live node's lease, unverified snapshots in a signed
run, content-addressed blobs that equal deltas share, and a learner that diverges.
"""

import anyio
import pytest
import torch
from msgspec.structs import replace
from reliability_helpers import CONFIG, FAST, Trainer, history, tiny_model

import gradientmail
from gradientmail._node.lease import LeaseBeats, run_lease
from gradientmail.clock import MonotonicClock
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys, records
from gradientmail.protocol.records import RoundClaim
from gradientmail.store import Store

pytestmark = pytest.mark.anyio


async def train(node: gradientmail.Node, model: torch.nn.Module, until_round: int) -> None:
    trainer = Trainer(model, seed=1)
    with anyio.fail_after(30):
        while node.state.round < until_round:
            trainer.step()
            await node.step(tokens=16)
            await anyio.sleep(0.002)


async def test_claims_planted_at_the_last_number_stop_nothing() -> None:
    box = MemoryMailbox()
    junk = records.encode(RoundClaim(learner="mallory"))
    await box.put_if_absent(keys.create_claim(9999), junk)
    for round in range(4):
        await box.put_if_absent(keys.round_claim(round, 9999), junk)
    model = tiny_model()
    async with gradientmail.node(model, box, learner="a", config=CONFIG, options=FAST) as node:
        await train(node, model, until_round=5)
    assert len(await history(box)) >= 6


async def test_beats_planted_under_a_live_lease_neither_kill_it_nor_refuse_its_restart() -> None:
    from gradientmail.protocol.liveness import LeaseWatch, Liveness

    box = MemoryMailbox()
    store = Store(box)
    await box.put_if_absent(keys.lease("victim", 10**12 - 1, "learner"), b"{}")
    await box.put_if_absent(keys.lease("victim", 1_000_000, "learner"), b"{}")
    watch = LeaseWatch(Liveness(timeout=0.5), every=0.0)
    clock = MonotonicClock()
    async with anyio.create_task_group() as tg:
        await tg.start(
            run_lease, LeaseBeats(store, "victim", "learner"), 0.05, clock, lambda _: None
        )
        start = clock.now()
        while clock.now() - start < 1.5:
            watch = watch.observed(await store.lease_beats(), clock.now())
            assert "victim" in watch.live(clock.now())
            assert "victim" in watch.learners
            await anyio.sleep(0.05)
        tg.cancel_scope.cancel()


async def test_a_signed_round_counts_only_snapshots_that_verify() -> None:
    box = MemoryMailbox()
    config = replace(CONFIG, grace=0.2)
    for round in range(3):
        await box.put_if_absent(keys.snapshot(round, "mallory"), b"x")
    model = tiny_model()
    async with gradientmail.node(
        model, box, learner="a", config=config, options=FAST, run_key="the run secret, long enough"
    ) as node:
        trainer = Trainer(model, seed=1)
        with anyio.fail_after(30):
            while node.state.round < 2:
                trainer.step()
                await node.step(tokens=16)
                # Slower than grace: a round the junk could close would close before "a"
                # publishes to it.
                await anyio.sleep(0.3)
    for record in (await history(box))[:3]:
        assert [p.learner for p in record.participants] == ["a"], record


async def test_equal_deltas_sharing_one_blob_survive_garbage_collection() -> None:
    box = MemoryMailbox()
    config = replace(CONFIG, keep_rounds=1, keep_versions=1)
    model = tiny_model()
    # Fragment 1 (the first bias and the last layer) never trains: every snapshot of it is
    # the same zero delta, one blob named by many snapshots and by zero updates.
    for param in [model[0].bias, *model[2].parameters()]:
        param.requires_grad_(False)
    async with gradientmail.node(model, box, learner="a", config=config, options=FAST) as node:
        await train(node, model, until_round=10)
    rejected = [r for record in await history(box) for r in record.rejected]
    assert rejected == []


async def test_a_diverged_learner_cannot_take_the_honest_model() -> None:
    box = MemoryMailbox()
    config = replace(CONFIG, max_tokens_per_step=1 << 20)
    honest, diverged = tiny_model(0), tiny_model(0)

    async def run_honest() -> None:
        async with gradientmail.node(honest, box, learner="a", config=config, options=FAST) as n:
            await train(n, honest, until_round=8)

    def diverge() -> None:
        with torch.no_grad():
            for param in diverged.parameters():
                param.fill_(3e38)

    async def run_diverged() -> None:
        async with gradientmail.node(diverged, box, learner="b", config=config, options=FAST) as n:
            with anyio.fail_after(30):
                while n.state.round < 8:
                    diverge()
                    await n.step(tokens=1 << 20)
                    await anyio.sleep(0.002)
            # Diverged at the close too: the step before may have reset it to the global θ
            # (its round rejected the snapshot), and a final of that is an honest one.
            diverge()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_honest)
        tg.start_soon(run_diverged)
    assert all(bool(torch.isfinite(p).all()) for p in honest.parameters())
    for record in await history(box):
        assert all(p.learner != "b" for p in record.participants), record


async def test_a_signed_run_ignores_beats_that_do_not_verify() -> None:
    from gradientmail.protocol.signing import RunKey

    box = MemoryMailbox()
    store = Store(box, run_key=RunKey("the run secret, long enough"))
    await box.put_if_absent(keys.lease("ghost", 5, "learner"), b"{}")
    await box.put_if_absent(keys.lease("victim", 10**12 - 1, "syncer"), b"{}")
    clock = MonotonicClock()
    async with anyio.create_task_group() as tg:
        await tg.start(
            run_lease, LeaseBeats(store, "victim", "learner"), 0.05, clock, lambda _: None
        )
        beats = await store.lease_beats()
        tg.cancel_scope.cancel()
    assert set(beats) == {"victim"}
    assert set(beats["victim"].values()) == {"learner"}
