"""Who closes rounds: takeover of a cancelled claimant, syncer-only nodes, learners that
do not sync."""

import collections
from collections.abc import Iterable, Sequence
from dataclasses import replace

import anyio
import msgspec
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    LEARNER_ONLY,
    Recorder,
    SharedView,
    Trainer,
    assert_holds_committed,
    assert_steps_accounted,
    commits_by_round,
    records,
    tiny_model,
    train,
    wait_until,
)

from gradientmail._node import node as open_node
from gradientmail.events import (
    AwaitingCreator,
    FollowingRound,
    RoundClaimed,
    RoundCommitted,
    RoundIncomplete,
    TookOverCreation,
    TookOverRound,
)
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.store import Store

pytestmark = pytest.mark.anyio


async def test_a_cancelled_claimant_is_taken_over_and_the_round_commits_once() -> None:
    box = MemoryMailbox()
    store = Store(box)
    sink = Recorder()
    # Every syncer counts only learners, so quorum_fraction=1.0 needs both learners.
    config = msgspec.structs.replace(CONFIG, quorum_fraction=1.0)
    async with open_node(tiny_model(), box, learner="creator", config=config, options=LEARNER_ONLY):
        pass

    async with anyio.create_task_group() as tg:
        first = anyio.CancelScope()

        async def syncer(name: str, scope: anyio.CancelScope) -> None:
            with scope:
                async with open_node(None, box, learner=name, options=FAST, sinks=[sink]):
                    await anyio.sleep_forever()

        tg.start_soon(syncer, "s1", first)

        async def claimed() -> bool:
            return await store.round_claims(0) == [(0, "s1")]

        await wait_until(claimed)
        second = anyio.CancelScope()
        tg.start_soon(syncer, "s2", second)

        async def following() -> bool:
            return any(e.learner == "s2" for e in sink.of(FollowingRound))

        await wait_until(following)
        first.cancel()  # s1 is mid-close: it holds round 0 and waits for snapshots

        finals = {}

        async def learner(name: str, seed: int) -> None:
            model = tiny_model(seed)
            async with open_node(
                model, box, learner=name, options=LEARNER_ONLY, sinks=[sink]
            ) as node:
                await train(node, model, seed=seed, until_round=6)
            finals[name] = (model, node.state)

        async with anyio.create_task_group() as learners:
            learners.start_soon(learner, "l1", 1)
            learners.start_soon(learner, "l2", 2)
        second.cancel()

    history = await records(box)
    assert history[0].committed_by == "s2"
    assert await store.round_claims(0) == [(0, "s1"), (1, "s2")]
    takeovers = sink.of(TookOverRound)
    assert [(e.round, e.cause, e.claimants) for e in takeovers][:1] == [(0, "lease_gone", ("s1",))]  # type: ignore[attr-defined]
    assert commits_by_round(sink.events) == {r.round: 1 for r in history}
    # Only syncer-only nodes closed rounds, and both learners took part in every round.
    assert {e.learner for e in sink.of(RoundCommitted)} <= {"s2"}
    assert {e.learner for e in sink.of(RoundClaimed)} <= {"s1", "s2"}
    assert {p.learner for r in history for p in r.participants} == {"l1", "l2"}
    for name, (model, state) in finals.items():
        await assert_holds_committed(box, model, state.versions)
        assert_steps_accounted(name, state.steps, state.tokens, sink.events, history)


class NoRecords:
    """The shared store, except that writing a round record never finishes: a claimant
    that is alive (its lease beats) but cannot commit."""

    def __init__(self, inner: MemoryMailbox) -> None:
        self.inner = inner

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.startswith("records/"):
            await anyio.sleep_forever()
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        return await self.inner.get(key, max_bytes=max_bytes)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        await self.inner.delete(keys)

    async def __aenter__(self) -> "NoRecords":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


async def test_a_live_claimant_that_never_commits_is_taken_over() -> None:
    box = MemoryMailbox()
    store = Store(box)
    sink = Recorder()
    patient = replace(FAST, claim_timeout=0.5)
    async with open_node(tiny_model(), box, learner="creator", config=CONFIG, options=LEARNER_ONLY):
        pass

    async with anyio.create_task_group() as tg:

        async def syncer(name: str, mailbox: object) -> None:
            async with open_node(
                None,
                mailbox,
                learner=name,
                options=patient,
                sinks=[sink],  # type: ignore[arg-type]
            ):
                await anyio.sleep_forever()

        tg.start_soon(syncer, "stuck", NoRecords(box))

        async def claimed() -> bool:
            return await store.round_claims(0) == [(0, "stuck")]

        await wait_until(claimed)
        tg.start_soon(syncer, "rescuer", box)

        async def learner(name: str, seed: int) -> None:
            model = tiny_model(seed)
            async with open_node(model, box, learner=name, options=LEARNER_ONLY) as node:
                await train(node, model, seed=seed, until_round=3)

        async with anyio.create_task_group() as learners:
            learners.start_soon(learner, "l1", 1)
            learners.start_soon(learner, "l2", 2)
        tg.cancel_scope.cancel()

    history = await records(box)
    assert history[0].committed_by == "rescuer"
    assert await store.round_claims(0) == [(0, "stuck"), (1, "rescuer")]
    takeover = [e for e in sink.of(TookOverRound) if e.round == 0]  # type: ignore[attr-defined]
    assert [(e.learner, e.cause) for e in takeover] == [("rescuer", "no_record")]  # type: ignore[attr-defined]
    assert await store.leases() == {}


async def test_a_stalled_creation_is_taken_over() -> None:
    box = MemoryMailbox()
    store = Store(box)
    sink = Recorder()
    assert await store.claim_creation(0, "ghost")
    options = replace(FAST, creation_timeout=0.3)
    model = tiny_model()
    async with open_node(
        model, box, learner="heir", config=CONFIG, options=options, sinks=[sink]
    ) as node:
        assert node.manifest.created_by == "heir"
    assert [e.claimants for e in sink.of(AwaitingCreator)] == [("ghost",)]  # type: ignore[attr-defined]
    assert len(sink.of(TookOverCreation)) == 1
    assert [k for k, _ in await store.create_claims()] == [0, 1]
    assert len(await store.init_markers(1)) == CONFIG.fragments


async def test_a_round_waits_for_a_learner_that_joined_but_has_not_published_yet() -> None:
    """A learner counts toward the quorum from the moment it joins (its lease says it
    trains), not from its first snapshot: round 0 stays in grace for the second learner
    instead of closing on the first learner's snapshot alone and leaving the second late."""
    box = MemoryMailbox()
    store = Store(box)
    config = msgspec.structs.replace(CONFIG, grace=60.0)
    due = CONFIG.sync_every // CONFIG.fragments
    models = {"a": tiny_model(0), "b": tiny_model(0)}
    with anyio.CancelScope() as scope:
        async with (
            open_node(models["a"], box, learner="a", config=config, options=FAST) as a,
            open_node(models["b"], box, learner="b", config=config, options=LEARNER_ONLY) as b,
        ):
            for node, seed in ((a, 0), (b, 1)):
                trainer = Trainer(models[node.learner], seed)
                for _ in range(due):
                    await anyio.to_thread.run_sync(trainer.step)
                    await node.step(tokens=16)

                async def published(name: str = node.learner) -> bool:
                    return name in await store.snapshot_learners(0)

                await wait_until(published)
                if node is a:
                    assert await store.record(0) is None, "round 0 closed before b published"

            async def committed() -> bool:
                return await store.record(0) is not None

            await wait_until(committed)
            record = await store.record(0)
            assert record is not None
            assert {p.learner for p in record.participants} == {"a", "b"}
            scope.cancel()


async def test_a_round_closed_without_a_live_learner_is_reported() -> None:
    box = MemoryMailbox()
    sink = Recorder()
    model = tiny_model()
    idle = tiny_model(1)
    # "idle" joins and holds a live lease but never steps: rounds close without it once "a"
    # alone is a quorum (the default, 1.0, would hold them open for "idle").
    config = msgspec.structs.replace(CONFIG, quorum_fraction=0.5)
    async with (
        open_node(model, box, learner="a", config=config, options=FAST, sinks=[sink]) as a,
        open_node(idle, box, learner="idle", options=LEARNER_ONLY, sinks=[sink]),
    ):
        await train(a, model, seed=1, until_round=a.state.round + 3)
    reports = sink.of(RoundIncomplete)
    assert reports, "no RoundIncomplete"
    assert all(r.missing == ("idle",) and not r.empty for r in reports)


@pytest.mark.timing
async def test_a_learner_slowed_for_a_stretch_rejoins_every_round_within_four() -> None:
    """Resynchronization: "b" steps 120 times slower than "a" for a stretch (rounds
    close without it after grace), then at the same speed again; from four rounds after the
    stretch on, every round has both, for ten rounds."""
    box = MemoryMailbox()
    # A grace well above a loaded machine's hiccups (two test workers on two cores can stall
    # a learner past half a second for three rounds); each step of the stretch is slower.
    # One learner is a quorum, so that rounds close without the slow one (the default, 1.0,
    # waits for it and never leaves it behind).
    config = msgspec.structs.replace(CONFIG, sync_every=4, grace=1.0, quorum_fraction=0.5)
    recovered: list[int] = []

    def until() -> int:
        return recovered[0] + 14 if recovered else 10**6

    async def learner(name: str, slow: range) -> None:
        model = tiny_model()
        async with open_node(model, box, learner=name, config=config, options=FAST) as node:
            trainer = Trainer(model, seed=1)
            step = 0
            with anyio.fail_after(60):
                while node.state.round < until():
                    await anyio.to_thread.run_sync(trainer.step)
                    await node.step(tokens=16)
                    step += 1
                    if step == slow.stop:
                        recovered.append(node.state.round)
                    await anyio.sleep(1.2 if step in slow else 0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(learner, "a", range(0))
        tg.start_soon(learner, "b", range(8, 12))
    history = await records(box)
    assert recovered
    alone = [len(r.participants) for r in history if r.round <= recovered[0]]
    assert min(alone) < 2, "the slow stretch never left a round without b"
    late = [r for r in history if recovered[0] + 4 < r.round <= until()]
    assert len(late) == 10
    assert [
        (r.round, [p.learner for p in r.participants]) for r in late if len(r.participants) < 2
    ] == []


class Reads(SharedView):
    """One node's view of a shared ``MemoryMailbox``, counting the blobs it reads."""

    def __init__(self, shared: MemoryMailbox) -> None:
        super().__init__(shared)
        self.blobs: collections.Counter[str] = collections.Counter()

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = await super().get(key, max_bytes=max_bytes)
        if data is not None and key.startswith(keys.BLOBS):
            self.blobs[key] += 1
        return data


async def test_a_syncer_only_node_reads_each_theta_once() -> None:
    """A syncer-only node holds no model, so it reads no θ when it joins: its syncer reads
    each fragment's when it first closes a round of it, and no blob twice."""
    shared = MemoryMailbox()
    reads = Reads(shared)
    store = Store(shared)
    model = tiny_model(0)
    syncer = replace(FAST, syncer=True)
    async with (
        open_node(model, shared, learner="a", config=CONFIG, options=LEARNER_ONLY) as a,
        open_node(None, reads, learner="s", config=CONFIG, options=syncer),
    ):
        await train(a, model, seed=0, until_round=2 * CONFIG.fragments)
    manifest = await store.manifest()
    assert manifest is not None
    theta0 = {keys.blob(ref.sha256) for ref in manifest.theta0}
    assert {key: reads.blobs[key] for key in theta0} == dict.fromkeys(theta0, 1)
    assert max(reads.blobs.values()) == 1, reads.blobs.most_common(3)
    assert {r.committed_by for r in await records(shared)} == {"s"}
