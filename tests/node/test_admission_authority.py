"""Admissions and revocations count only under the operator's admission key: a learner node,
which holds the run key to close rounds, cannot admit a key of its own for another learner
nor revoke an honest learner's key. Real nodes on a real local directory."""

import logging
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
from msgspec import UNSET
from msgspec.structs import replace as replace_struct
from node_helpers import (
    CONFIG,
    FAST,
    Trainer,
    created_manifest,
    forged_snapshot,
    records,
    tiny_model,
    wait_until,
)

from gradientmail._node import Node, NodeOptions
from gradientmail._node import node as open_node
from gradientmail.admission import admit
from gradientmail.errors import RunMismatch
from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.identities import (
    REFRESH_EVERY,
    Admission,
    AdmissionKey,
    LearnerKey,
    Revocation,
    identity_key,
)
from gradientmail.protocol.records import RoundRecord, encode
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

SECRET = "the run key every node of the run holds"
RUN_KEY = RunKey(SECRET)
ADMISSION_KEY = AdmissionKey.generate()


def keyed(key: LearnerKey, admission_key: str = ADMISSION_KEY.public) -> NodeOptions:
    return replace(FAST, learner_key=key, admission_key=admission_key)


async def _run_key_signed(box: Mailbox, obj: Admission | Revocation) -> str:
    """Write ``obj`` as a node holding only the run key can: signed with the run key."""
    run = (await created_manifest(box)).run_id
    assert isinstance(run, str)
    key = identity_key(type(obj), obj.public_key)
    assert await box.put_if_absent(key, encode(RUN_KEY.sign(key, obj, run)))
    return key


async def _member(box: Mailbox, name: str, key: LearnerKey, seed: int, done: anyio.Event) -> None:
    model = tiny_model(seed)
    trainer = Trainer(model, seed)
    node: Node
    async with open_node(
        model, box, learner=name, config=CONFIG, options=keyed(key), run_key=SECRET
    ) as node:
        with anyio.fail_after(90):
            while not done.is_set():
                await anyio.to_thread.run_sync(trainer.step)
                await node.step(tokens=16)
                await anyio.sleep(0.001)


async def _after_refresh(box: Mailbox) -> int:
    """The number of rounds committed once every node has listed ``identities/`` again
    (each does within ``REFRESH_EVERY`` of its next look at snapshots)."""
    until = anyio.current_time() + 2 * REFRESH_EVERY

    async def refreshed() -> bool:
        return anyio.current_time() >= until

    await wait_until(refreshed)
    return len(await records(box))


def _rejected(history: list[RoundRecord], learner: str) -> dict[int, str]:
    return {r.round: x.reason for r in history for x in r.rejected if x.learner == learner}


async def test_a_learner_cannot_admit_its_own_key_for_another_learner(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path / "store")
    ka, kb, kc = (LearnerKey.generate() for _ in range(3))
    done = anyio.Event()
    forged_rounds: list[int] = []

    async def b_forges_as_c() -> None:
        manifest = await created_manifest(box)
        await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)
        await admit(box, "c", kc.public, RUN_KEY, ADMISSION_KEY)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_member, box, "b", kb, 1, done)
            # An admission as any holder of the run key can sign it: b's node admits its own
            # key for c.
            await _run_key_signed(box, Admission(learner="c", public_key=kb.public))
            # Far enough ahead that no forged round closes before its snapshot is written,
            # however fast the learners' rounds go.
            ahead = await _after_refresh(box) + 6
            run = manifest.run_id
            assert isinstance(run, str)
            for round in range(ahead, ahead + 4):
                key = keys.snapshot(round, "c")
                snapshot = kb.sign(
                    key, await forged_snapshot(box, manifest, round, "c", fill=0.0), run
                )
                assert await box.put_if_absent(key, encode(snapshot))
                forged_rounds.append(round)

            async def judged() -> bool:
                return len(await records(box)) > forged_rounds[-1]

            await wait_until(judged, limit=60)
            done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(_member, box, "a", ka, 0, done)
        tg.start_soon(b_forges_as_c)

    history = await records(box)
    assert _rejected(history, "c") == dict.fromkeys(forged_rounds, "bad-signature")
    assert not any(p.learner == "c" for r in history for p in r.participants)
    assert {p.learner for r in history for p in r.participants} == {"a", "b"}
    with pytest.raises(RunMismatch, match="not admitted"):
        async with open_node(tiny_model(), box, learner="c", options=keyed(kb), run_key=SECRET):
            pass


async def test_a_learner_cannot_revoke_an_honest_learners_key(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path / "store")
    ka, kb = LearnerKey.generate(), LearnerKey.generate()
    done = anyio.Event()

    async def a_revokes_b() -> None:
        await created_manifest(box)
        await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)

        async def b_took_part(since: int) -> bool:
            history = (await records(box))[since:]
            return any(p.learner == "b" for r in history for p in r.participants)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_member, box, "b", kb, 1, done)
            await wait_until(lambda: b_took_part(0), limit=60)
            await _run_key_signed(box, Revocation(public_key=kb.public))
            since = await _after_refresh(box)
            await wait_until(lambda: b_took_part(since + 1), limit=60)
            done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(_member, box, "a", ka, 0, done)
        tg.start_soon(a_revokes_b)

    assert "revoked" not in _rejected(await records(box), "b").values()
    async with open_node(tiny_model(), box, learner="b", options=keyed(kb), run_key=SECRET):
        pass


async def test_a_run_key_signed_admission_is_ignored_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    box = MemoryMailbox()
    ka, kb = LearnerKey.generate(), LearnerKey.generate()
    async with open_node(
        tiny_model(), box, learner="a", config=CONFIG, options=keyed(ka), run_key=SECRET
    ):
        pass
    forged = await _run_key_signed(box, Admission(learner="b", public_key=kb.public))
    store = Store(box, run_key=RUN_KEY, learner_key=kb)
    assert await store.manifest() is not None
    with caplog.at_level(logging.WARNING, logger="gradientmail.store"):
        assert not await store.refresh_identities(now=True)
        assert not await store.refresh_identities(now=True)
    assert "bad-signature: not signed with the run's admission key" in store.ignored[forged]
    assert [r.getMessage() for r in caplog.records if forged in r.getMessage()] == [
        f"{forged}: skipped: {store.ignored[forged]}"
    ]
    with pytest.raises(RunMismatch, match="not admitted"):
        store.signing.check_member("b", ADMISSION_KEY.public)


async def test_nodes_hold_only_the_admission_public_key_and_check_it(tmp_path: Path) -> None:
    box = LocalMailbox(tmp_path / "store")
    ka, kb = LearnerKey.generate(), LearnerKey.generate()
    with pytest.raises(ValueError, match="admission_key go together"):
        replace(FAST, learner_key=ka)
    with pytest.raises(TypeError, match="never holds the private key"):
        replace(FAST, learner_key=ka, admission_key=ADMISSION_KEY)  # type: ignore[arg-type]
    async with open_node(
        tiny_model(), box, learner="a", config=CONFIG, options=keyed(ka), run_key=SECRET
    ):
        pass
    manifest = await created_manifest(box)
    assert manifest.admission_key == ADMISSION_KEY.public
    assert manifest.learners == {"a": ka.public}
    await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)
    other = AdmissionKey.generate()
    with pytest.raises(RunMismatch, match="admission key"):
        await admit(box, "b", kb.public, RUN_KEY, other)
    with pytest.raises(RunMismatch, match="admission key"):
        async with open_node(
            tiny_model(), box, learner="b", options=keyed(kb, other.public), run_key=SECRET
        ):
            pass
    async with open_node(tiny_model(), box, learner="b", options=keyed(kb), run_key=SECRET):
        pass


async def test_a_run_with_identities_but_no_admission_key_is_refused() -> None:
    """A run with identities whose manifest names no admission key: nothing there is
    trusted as an admission and no node joins it."""
    box = MemoryMailbox()
    ka, kb = LearnerKey.generate(), LearnerKey.generate()
    async with open_node(
        tiny_model(), box, learner="a", config=CONFIG, options=keyed(ka), run_key=SECRET
    ):
        pass
    new = await created_manifest(box)
    old = replace_struct(new, admission_key=UNSET, signature=UNSET)
    await box.delete([keys.MANIFEST])
    assert await box.put_if_absent(keys.MANIFEST, encode(RUN_KEY.sign(keys.MANIFEST, old)))
    forged = await _run_key_signed(box, Admission(learner="b", public_key=kb.public))
    with pytest.raises(RunMismatch, match="names no admission key"):
        async with open_node(tiny_model(), box, learner="a", options=keyed(ka), run_key=SECRET):
            pass
    with pytest.raises(RunMismatch, match="names no admission key"):
        await admit(box, "b", kb.public, RUN_KEY, ADMISSION_KEY)
    reader = Store(box, run_key=RUN_KEY)
    assert await reader.manifest() == RUN_KEY.sign(keys.MANIFEST, old)
    await reader.refresh_identities(now=True)
    assert "names no admission key" in reader.ignored[forged]
    assert reader.signing.identities is not None
    assert not reader.signing.identities.speaks_for(kb.public, "b")
