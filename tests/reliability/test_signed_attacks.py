"""Signed runs against a writer without the key (Mallory): she can put any object into the
bucket, but she cannot get a delta into a round (``tests/node/test_signed.py``), claim a
round, stall creation or make anyone follow a record she forged.

Claims she forges, or replays from elsewhere in the run, name nobody: the round is taken
over at once. Creation claims and Θ⁰ markers she forges do not hold creation up beyond one
``creation_timeout``. A record she forges at a round's key is never adopted: every syncer
and learner reports it (``RoundFailed``/``PollFailed`` carrying ``SignatureError`` with its
reason) and nobody's weights move past the round before it. (She does block that round
forever: squatting a create-once key is a denial of service no signature can prevent; see
``docs/reliability.md``.)
"""

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest
from reliability_helpers import (
    CONFIG,
    FAST,
    Recorder,
    Trainer,
    commits_by_round,
    history,
    tiny_model,
)

import gradientmail
from gradientmail.events import (
    AwaitingCreator,
    Joined,
    PollFailed,
    RoundFailed,
    TookOverCreation,
    TookOverRound,
)
from gradientmail.events.sinks import json_logs
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys, records
from gradientmail.protocol.records import (
    BlobRef,
    CreateClaim,
    InitMarker,
    Manifest,
    RoundClaim,
    RoundRecord,
)
from gradientmail.protocol.signing import ENV_VAR, RunKey
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

SECRET = "the run's secret, which Mallory does not have"
MALLORY = RunKey("Mallory's own key, which is not the run's")


async def _train(
    box: MemoryMailbox, name: str, seed: int, until: int, sink: Recorder, **options: float
) -> None:
    model = tiny_model(seed)
    async with gradientmail.node(
        model,
        box,
        learner=name,
        config=CONFIG,
        options=replace(FAST, **options),
        sinks=[sink],
        run_key=SECRET,
    ) as node:
        trainer = Trainer(model, seed)
        with anyio.fail_after(60):
            while node.state.round < until:
                trainer.step()
                await node.step(tokens=16)
                await anyio.sleep(0.002)


async def test_forged_and_replayed_claims_name_nobody() -> None:
    box = MemoryMailbox()
    honest = RunKey(SECRET)
    # Unsigned, signed with another key, and a genuine claim of "a" replayed from round 1.
    await box.put_if_absent(keys.round_claim(2, 0), records.encode(RoundClaim(learner="a")))
    forged = MALLORY.sign(keys.round_claim(4, 0), RoundClaim(learner="mallory"))
    await box.put_if_absent(keys.round_claim(4, 0), records.encode(forged))
    genuine = honest.sign(keys.round_claim(1, 7), RoundClaim(learner="a"))
    await box.put_if_absent(keys.round_claim(6, 0), records.encode(genuine))
    sink = Recorder()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_train, box, "a", 0, 9, sink)
            tg.start_soon(_train, box, "b", 1, 9, sink)
    found = await history(box)
    assert len(found) >= 10
    assert commits_by_round(sink.events) == {r.round: 1 for r in found}
    assert {r.committed_by for r in found} <= {"a", "b"}
    for round in (2, 4, 6):
        takeovers = [e for e in sink.of(TookOverRound) if e.round == round]
        assert takeovers, f"round {round} was not taken over from its forged claim"
        assert all(e.claimants[0] == "" for e in takeovers)  # type: ignore[attr-defined]
        # Taken over at once: no claim timeout was waited out.
        assert all(e.cause == "lease_gone" for e in takeovers)  # type: ignore[attr-defined]


async def test_forged_creation_claims_and_markers_do_not_stall_creation() -> None:
    """Mallory holds the creation claims and keeps adding Θ⁰ markers under the newest one,
    as a creator making progress would: her claims name nobody, so the honest node takes
    over creation at once, well within one ``creation_timeout``."""
    box = MemoryMailbox()
    ref = BlobRef(sha256="0" * 64, size=1, encoding="fp32")
    for attempt in (0, 1):
        await box.put_if_absent(
            keys.create_claim(attempt), records.encode(CreateClaim(learner="a"))
        )
    sink = Recorder()
    timeout = 0.5

    async def mallory() -> None:
        for fragment in range(1000):
            marker = InitMarker(learner="a", fragment=fragment, blob=ref)
            await box.put_if_absent(keys.init_marker(1, fragment), records.encode(marker))
            if await box.get(keys.MANIFEST) is not None:
                return
            await anyio.sleep(timeout / 5)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(mallory)
            tg.start_soon(partial(_train, box, "a", 0, 1, sink, creation_timeout=timeout))
    joined = sink.of(Joined)[0]
    assert joined.created_by == "a"  # type: ignore[attr-defined]
    assert sink.of(AwaitingCreator)
    (took_over,) = sink.of(TookOverCreation)
    assert took_over.stalled < timeout  # type: ignore[attr-defined]


async def test_a_forged_record_is_skipped_and_the_run_goes_on() -> None:
    """Mallory squats the key of round 4's record with an unsigned copy of round 0's record
    before round 4 closes: nobody follows it, the round commits at the key's successor
    (signed), and the run goes on past it."""
    box = MemoryMailbox()
    sink = Recorder()
    forged_at = 4

    async def mallory() -> None:
        with anyio.fail_after(30):
            while (data := await box.get(keys.record(0))) is None:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        genuine = records.decode(data, RoundRecord)
        fake = msgspec.structs.replace(
            genuine, round=forged_at, version=forged_at // 2 + 1, signature=msgspec.UNSET
        )
        await box.put_if_absent(keys.record(forged_at), records.encode(fake))

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with gradientmail.node(
            model, box, learner=name, config=CONFIG, options=FAST, sinks=[sink], run_key=SECRET
        ) as node:
            trainer = Trainer(model, seed)
            with anyio.fail_after(60):
                while node.state.round < forged_at + 2:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)

    async with anyio.create_task_group() as tg:
        tg.start_soon(mallory)
        tg.start_soon(member, "a", 0)
        tg.start_soon(member, "b", 1)

    store = Store(box, run_key=RunKey(SECRET))
    manifest = await store.manifest()
    assert manifest is not None
    assert isinstance(manifest.run_id, str)
    squatted = await box.get(keys.record(forged_at))
    assert squatted is not None
    assert RunKey(SECRET).check(keys.record(forged_at), squatted, manifest.run_id) == "unsigned"
    successor = keys.record_slot(forged_at, 1)
    data = await box.get(successor)
    assert data is not None
    assert RunKey(SECRET).check(successor, data, manifest.run_id) is None
    record = await store.record(forged_at)
    assert record is not None
    assert records.decode(data, RoundRecord) == record
    assert await store.record_rounds() == list(range(len(await store.record_rounds())))
    assert len(await store.record_rounds()) > forged_at + 1
    assert not sink.of(RoundFailed)
    assert not sink.of(PollFailed)


async def test_the_run_key_is_never_written_or_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed run from the environment variable, with every event in a JSON log and
    every library log captured: the secret is in no object of the store, no log line, no
    event, and no repr of the node or its state."""
    secret = "hunter2-but-much-longer-and-unguessable"
    monkeypatch.setenv(ENV_VAR, secret)
    caplog.set_level(logging.DEBUG, logger="gradientmail")
    box = MemoryMailbox()
    log = tmp_path / "events.jsonl"
    sink = Recorder()
    shown: list[str] = []

    async def member(name: str, seed: int) -> None:
        model = tiny_model(seed)
        async with gradientmail.node(
            model, box, learner=name, config=CONFIG, options=FAST, sinks=[sink, json_logs(log)]
        ) as node:
            trainer = Trainer(model, seed)
            with anyio.fail_after(60):
                while node.state.round < 4:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)
            shown.extend([repr(node), repr(node.state), repr(node.manifest)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(member, "a", 0)
        tg.start_soon(member, "b", 1)

    manifest = records.decode(await box.get(keys.MANIFEST) or b"", Manifest)
    assert manifest.key_id == RunKey(secret).key_id
    needles = (secret.encode(), secret.encode().hex().encode())
    for key in await box.list(""):
        data = await box.get(key) or b""
        assert not any(needle in data for needle in needles), key
    text = log.read_text() + caplog.text + "".join(map(repr, sink.events)) + "".join(shown)
    assert log.read_text()
    assert not any(needle.decode() in text for needle in needles)
