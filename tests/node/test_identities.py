"""Learner identities: each learner signs its snapshots and beats with its own key, so one
learner cannot speak for another and a leaked key can be revoked, with real nodes on a real
local directory."""

from dataclasses import replace
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from node_helpers import (
    CONFIG,
    FAST,
    assert_holds_committed,
    created_manifest,
    forged_snapshot,
    records,
    tiny_model,
    train,
    wait_until,
)

from gradientmail._node import NodeOptions
from gradientmail._node import node as open_node
from gradientmail.admission import admit, revoke
from gradientmail.errors import RunMismatch
from gradientmail.mailbox import LocalMailbox, Mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.identities import Admission, AdmissionKey, LearnerKey, identity_key
from gradientmail.protocol.records import Manifest, RoundRecord, decode, encode
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

SECRET = "correct horse battery staple, twice over"
RUN_KEY = RunKey(SECRET)
ADMISSION_KEY = AdmissionKey.generate()


def keyed(key: LearnerKey) -> NodeOptions:
    return replace(FAST, learner_key=key, admission_key=ADMISSION_KEY.public)


def _reasons(history: list[RoundRecord], learner: str) -> set[str]:
    return {x.reason for r in history for x in r.rejected if x.learner == learner}


async def test_learners_sign_with_their_own_keys_and_cannot_speak_for_another(
    tmp_path: Path,
) -> None:
    box = LocalMailbox(tmp_path / "store")
    ka, kb, kc, kd = (LearnerKey.generate() for _ in range(4))
    finals = {}
    admitted = anyio.Event()
    expected: dict[tuple[int, str], str] = {}

    async def member(name: str, key: LearnerKey, seed: int) -> None:
        model = tiny_model(seed)
        async with open_node(
            model, box, learner=name, config=CONFIG, options=keyed(key), run_key=SECRET
        ) as node:
            await train(node, model, seed=seed, until_round=24)
        finals[name] = (model, node.state)

    async def start_b() -> None:
        await created_manifest(box)
        await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)
        await admit(box, "c", kc.public, RUN_KEY, ADMISSION_KEY)
        admitted.set()
        await member("b", kb, 1)

    async def forge() -> None:
        """b's key holder speaks for c (admitted, never runs); others forge as c and d."""
        manifest = await created_manifest(box)
        run = manifest.run_id
        assert isinstance(run, str)
        await admitted.wait()
        # Neither junk nor an admission without the admission key's signature lets d's key
        # speak for c.
        await box.put_if_absent(identity_key(Admission, kd.public, "junk"), b"junk")
        unsigned = Admission(learner="c", public_key=kd.public)
        await box.put_if_absent(identity_key(Admission, kd.public), encode(unsigned))
        forged = kb.sign(identity_key(Admission, kd.public, "b"), unsigned, run)
        await box.put_if_absent(identity_key(Admission, kd.public, "b"), encode(forged))
        ahead = len(await _committed(box)) + 3
        signers = [
            ("c", "bad-signature", lambda k, s: kb.sign(k, s, run)),  # under b's key
            ("c", "bad-signature", lambda k, s: RUN_KEY.sign(k, s, run)),  # run key's MAC
            ("c", "unsigned", lambda k, s: s),
            ("c", "bad-signature", lambda k, s: kd.sign(k, s, run)),  # d's key
            ("d", "not-admitted", lambda k, s: kd.sign(k, s, run)),  # its own key
        ]
        for round, (learner, reason, sign) in enumerate(signers, start=ahead):
            expected[round, learner] = reason
            key = keys.snapshot(round, learner)
            await box.put_if_absent(
                key, encode(sign(key, await forged_snapshot(box, manifest, round, learner)))
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(member, "a", ka, 0)
        tg.start_soon(start_b)
        tg.start_soon(forge)

    history = await records(box)
    rejected = {
        (r.round, x.learner): x.reason for r in history for x in r.rejected if x.learner in "cd"
    }
    assert rejected == expected
    assert all(p.learner in ("a", "b") for r in history for p in r.participants)
    assert {p.learner for r in history for p in r.participants} == {"a", "b"}
    assert not _reasons(history, "a") | _reasons(history, "b")
    manifest = decode(await box.get(keys.MANIFEST) or b"", Manifest)
    assert manifest.learners == {"a": ka.public}
    for model, state in finals.values():
        await assert_holds_committed(box, model, state.versions)
        assert all(torch.isfinite(p).all() and p.abs().max() < 100 for p in model.parameters())
    data = await box.get(keys.snapshot(1, "a"))
    assert data is not None
    assert b'"signature":"ed25519:' in data


async def test_a_revoked_keys_later_snapshots_are_rejected_and_earlier_rounds_stay(
    tmp_path: Path,
) -> None:
    box = LocalMailbox(tmp_path / "store")
    ka, kb = LearnerKey.generate(), LearnerKey.generate()
    before: dict[int, bytes] = {}

    async def member(name: str, key: LearnerKey, seed: int, until: int, compute: float) -> None:
        model = tiny_model(seed)
        async with open_node(
            model, box, learner=name, config=CONFIG, options=keyed(key), run_key=SECRET
        ) as node:
            await train(node, model, seed=seed, until_round=until, compute=compute)

    async def start_b() -> None:
        await created_manifest(box)
        await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)
        await member("b", kb, 1, 40, 0.001)

    async def operator() -> None:
        async def b_committed() -> bool:
            return any(p.learner == "b" for r in await _committed(box) for p in r.participants)

        await wait_until(b_committed, limit=60)
        for round in range(len(await _committed(box))):
            before[round] = await box.get(keys.record(round)) or b""
        await revoke(box, kb.public, RUN_KEY, ADMISSION_KEY)

    async with anyio.create_task_group() as tg:
        # Rounds do not wait for a revoked learner (its lease does not count): b steps ten
        # times as fast as a, so its snapshot of a round is listed before a's closes it.
        tg.start_soon(member, "a", ka, 0, 40, 0.01)
        tg.start_soon(start_b)
        tg.start_soon(operator)

    history = await records(box)
    assert any(p.learner == "b" for r in history[: len(before)] for p in r.participants)
    for round, data in before.items():
        assert await box.get(keys.record(round)) == data
    revoked = [r.round for r in history for x in r.rejected if x.learner == "b"]
    assert revoked, "no round rejected the revoked key"
    assert all(x.reason == "revoked" for r in history for x in r.rejected if x.learner == "b")
    # Each node takes the revocation up within REFRESH_EVERY: the newest rounds are a's alone.
    assert not any(p.learner == "b" for r in history[-3:] for p in r.participants)
    with pytest.raises(RunMismatch, match="revoked"):
        async with open_node(tiny_model(), box, learner="b", options=keyed(kb), run_key=SECRET):
            pass


async def _committed(box: Mailbox) -> list[RoundRecord]:
    store = Store(box)
    found = []
    for round in await store.record_rounds():
        record = await store.record(round)
        if record is None:
            break
        found.append(record)
    return found


async def test_who_may_join_a_run_with_identities(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path / "store")
    ka, kb = LearnerKey.generate(), LearnerKey.generate()
    async with open_node(
        tiny_model(), box, learner="a", config=CONFIG, options=keyed(ka), run_key=SECRET
    ):
        pass
    with pytest.raises(RunMismatch, match="not admitted"):
        async with open_node(tiny_model(), box, learner="b", options=keyed(kb), run_key=SECRET):
            pass
    with pytest.raises(RunMismatch, match="not admitted"):
        async with open_node(tiny_model(), box, learner="b", options=keyed(ka), run_key=SECRET):
            pass
    with pytest.raises(RunMismatch, match="no learner key"):
        async with open_node(tiny_model(), box, learner="b", options=FAST, run_key=SECRET):
            pass
    await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)
    async with open_node(tiny_model(), box, learner="b", options=keyed(kb), run_key=SECRET):
        pass
    with pytest.raises(ValueError, match="run key"):
        async with open_node(tiny_model(), box, learner="b", options=keyed(kb)):
            pass


async def test_a_run_created_without_learner_keys_is_as_before(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path / "store")
    async with open_node(
        tiny_model(), box, learner="a", config=CONFIG, options=FAST, run_key=SECRET
    ):
        pass
    assert "learners" not in msgspec.json.decode(await box.get(keys.MANIFEST) or b"{}")
    with pytest.raises(RunMismatch, match="no learner identities"):
        async with open_node(
            tiny_model(), box, learner="b", options=keyed(LearnerKey.generate()), run_key=SECRET
        ):
            pass
    with pytest.raises(RunMismatch, match="no learner identities"):
        await admit(box, "b", LearnerKey.generate().public, RUN_KEY, ADMISSION_KEY)
