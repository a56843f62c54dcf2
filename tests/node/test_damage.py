"""Damage stays local: a corrupt update falls back to the round's θ; a
fragment whose versions cannot be used at all does not hold up the others, and is reported
once per record, not at every poll.

The learner reads the store through ``Damaging``, which flips one byte of chosen blobs on
every read; a syncer-only node reads the same store undamaged, so rounds keep closing."""

import anyio
import msgspec
import pytest
from node_helpers import (
    CONFIG,
    FAST,
    LEARNER_ONLY,
    Recorder,
    Trainer,
    assert_holds_committed,
    tiny_model,
    train,
)

from gradientmail._node import node as open_node
from gradientmail.errors import RecordError
from gradientmail.events import PollFailed
from gradientmail.mailbox import MemoryMailbox
from gradientmail.mailbox.faults import Faults, FaultyMailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import RoundRecord, decode

pytestmark = pytest.mark.anyio


class Damaging(FaultyMailbox):
    """``inner`` as the learner sees it (no injected faults): every blob a record names for
    one of ``which`` (``"update"``, ``"theta"``) of a fragment in ``fragments`` comes back
    with one byte flipped."""

    def __init__(
        self, inner: MemoryMailbox, which: set[str], fragments: set[int] | None = None
    ) -> None:
        super().__init__(inner, Faults())
        self.which = which
        self.fragments = fragments
        self.damaged: set[str] = set()
        self.flipped = 0

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = await super().get(key, max_bytes=max_bytes)
        if data is None:
            return None
        if keys.parse_record(key) is not None:
            record = decode(data, RoundRecord)
            if self.fragments is None or record.fragment in self.fragments:
                refs = {"update": record.update, "theta": record.theta}
                self.damaged |= {keys.blob(ref.sha256) for w in self.which if (ref := refs[w])}
        if key in self.damaged:
            self.flipped += 1
            return data[:-1] + bytes([data[-1] ^ 0x01])
        return data


async def syncer(box: MemoryMailbox, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    async with open_node(None, box, learner="closer", options=FAST):
        task_status.started()
        await anyio.sleep_forever()


async def test_corrupt_updates_fall_back_to_theta_and_training_goes_on() -> None:
    """Every version a checkpoint (``checkpoint_every=1``): each record names its θ, which
    the learner falls back to."""
    box = MemoryMailbox()
    view = Damaging(box, {"update"})
    model = tiny_model(1)
    sink = Recorder()
    every = msgspec.structs.replace(CONFIG, checkpoint_every=1)
    async with anyio.create_task_group() as tg:
        async with open_node(
            model, view, learner="l", config=every, options=LEARNER_ONLY, sinks=[sink]
        ) as node:
            await tg.start(syncer, box)
            await train(node, model, seed=1, until_round=8, limit=30)
            # Every version of both fragments came through the θ blob.
            assert min(node.state.versions) >= 3
        tg.cancel_scope.cancel()
    assert view.flipped > 0
    assert not sink.of(PollFailed)
    await assert_holds_committed(box, model, node.state.versions)


async def test_a_fragment_that_cannot_be_prepared_holds_up_no_other_and_is_reported_once() -> None:
    box = MemoryMailbox()
    view = Damaging(box, {"update", "theta"}, fragments={0})
    model = tiny_model(1)
    sink = Recorder()
    async with anyio.create_task_group() as tg:
        # Left by cancelling: fragment 0's steps can never be flushed.
        with anyio.CancelScope() as leave:
            async with open_node(
                model, view, learner="l", config=CONFIG, options=LEARNER_ONLY, sinks=[sink]
            ) as node:
                await tg.start(syncer, box)
                with anyio.fail_after(30):
                    while node.state.versions[1] < 4:
                        await train(node, model, seed=1, until_round=node.state.round + 1)
                assert node.state.versions[0] == 0
                leave.cancel()
        tg.cancel_scope.cancel()
    reports = sink.of(PollFailed)
    stuck = {e.error.args[0].split(" ")[1] for e in reports}  # type: ignore[attr-defined]
    assert reports
    assert all(isinstance(e.error, RecordError) for e in reports)  # type: ignore[attr-defined]
    assert all("neither its update nor its θ" in str(e.error) for e in reports)  # type: ignore[attr-defined]
    assert len(reports) == len(stuck), "each unusable record is reported once"


async def test_a_junk_record_is_skipped_not_reported_at_every_poll() -> None:
    """A record object that does not decode sits at the next round's key. The store
    skips junk at a create-once key for its successor, so it is no failure at all: the
    learner polls on (50 a second here) and trains, reporting nothing."""
    box = MemoryMailbox()
    model = tiny_model(1)
    trainer = Trainer(model, 1)
    sink = Recorder()
    with anyio.CancelScope() as leave:  # left by cancelling: no round can commit here
        async with open_node(
            model, box, learner="l", config=CONFIG, options=LEARNER_ONLY, sinks=[sink]
        ) as node:
            assert await box.put_if_absent(keys.record(0), b"{not a record")
            with anyio.fail_after(30):
                for _ in range(50):  # a poll interval a step: 50 polls at least
                    trainer.step()
                    await node.step(16)
                    await anyio.sleep(FAST.poll_interval)
            leave.cancel()
    assert sink.of(PollFailed) == []
