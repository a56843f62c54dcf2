"""Garbage collection under the chaos writer: with retention small enough that every few
rounds collect, the hostile writer of ``test_chaos.py`` plants every family it knows (junk,
forgeries, deltas) and the attack on collection itself: snapshots in the rounds ahead, in
the round's fragment, naming the θ, momentum and update blobs of the versions the run must
retain (of both fragments) and the deltas their momentum replays from (unsigned run:
well-formed ghost snapshots; signed run: unsigned, or signed with another key, also at an
honest learner's key), and well-formed records naming those blobs (behind a committed round's
record, or ahead: misfiled in the unsigned run, unverified in the signed one). Unsigned and
signed, on both event loops.

Pass: no node raises and every learner reaches the target round; collection ran (at least
one pass every other round, and it deleted blobs) and no delete, checked as it happens,
took a blob that Θ⁰ or a record retained after the newest committed round names; some
planted snapshot was collected while a blob it names was retained; after the run every blob
the retained records and kept snapshots name is there, ``RunReader.rebuild`` gives every
retained version with its momentum, and the version before each retained checkpoint
stepped once more by hand gives that checkpoint's θ bit for bit (and its momentum where the
checkpoint round's snapshots are kept); a node joining afterwards holds the newest θ and
trains.

``test_gc_under_chaos`` trains to round 24 (about 20 collection passes); ``test_gc_soak_full``
to round 120 under ``GRADIENTMAIL_SOAK=1`` (the ``soak`` nox session).
"""

import os
from collections.abc import Iterable

import anyio
import msgspec
import pytest
import torch
from reliability_helpers import (
    CONFIG,
    FAST,
    Trainer,
    assert_weights,
    history,
    newest_theta,
    tiny_model,
)
from test_chaos import ATTACKS, HONEST, SECRET, Chaos, _record, _replays, run_under_chaos

import gradientmail
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys, records
from gradientmail.protocol.checkpoint import base, is_checkpoint, mean_of, replayed, retained
from gradientmail.protocol.codec import decode_fragment, open_delta, tensors_of
from gradientmail.protocol.records import (
    BlobRef,
    Manifest,
    RoundRecord,
    RunConfig,
    Snapshot,
    SnapshotPart,
)
from gradientmail.protocol.signing import RunKey
from gradientmail.reader import RunReader
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

GC = msgspec.structs.replace(CONFIG, keep_rounds=3, keep_versions=3, checkpoint_every=2)
"""Collection from the fourth round on; every fragment keeps three versions and the
checkpoint below them, so at least two checkpoints (one to start from, one to check)."""
OTHER_KEY = RunKey("not this run's key, though long enough")


class Ledger(MemoryMailbox):
    """A memory mailbox that checks every delete before doing it: against what the run's
    newest committed round retains (``retained_blobs``), and for the snapshots planted
    in the rounds it collects (``planted``) whose blobs are among those."""

    def __init__(self, run_key: RunKey | None) -> None:
        super().__init__()
        self.store = Store(self, run_key=run_key)
        self.planted: list[tuple[int, set[str]]] = []
        """Every planted snapshot that landed: its round and the blobs it names."""
        self.deleted: set[str] = set()
        self.passes = 0
        """Deletes of collected rounds' objects or blobs: collection passes."""
        self.retained_deleted: set[str] = set()
        """Blobs the newest retained records needed when they were deleted."""
        self.threats = 0
        """Planted snapshots collected while a blob they name was retained."""

    async def delete(self, keys_: Iterable[str]) -> None:
        batch = list(keys_)
        blobs = {key.removeprefix(keys.BLOBS) for key in batch if key.startswith(keys.BLOBS)}
        rounds = {int(key.split("/")[1]) for key in batch if key.startswith(keys.ROUNDS)}
        if rounds or blobs:
            needed = await retained_blobs(self.store, GC)
            self.passes += 1
            self.retained_deleted |= blobs & needed
            self.threats += sum(1 for r, names in self.planted if r in rounds and names & needed)
        self.deleted |= blobs
        await super().delete(batch)


async def retained_blobs(store: Store, config: RunConfig) -> set[str]:
    """The blobs that Θ⁰ and the records retained after the newest committed round name
    (those ``store`` can read)."""
    manifest = await store.manifest()
    assert manifest is not None
    rounds = await store.record_rounds()
    names = {ref.sha256 for ref in manifest.theta0}
    for round in retained(rounds[-1], config).records if rounds else ():
        if (record := await store.record(round)) is not None:
            names |= {ref.sha256 for ref in (record.theta, record.outer, record.update) if ref}
    return names


class Bait:
    """The attack on collection: each call plants a snapshot and a record naming blobs
    that the run will still retain when the planted round is collected (by
    ``checkpoint.retained``), read (verified) from the committed rounds."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.targets: tuple[int, list[BlobRef]] = (-1, [])

    async def __call__(self, chaos: Chaos) -> None:
        store = self.ledger.store
        if (manifest := await store.manifest()) is None:
            return
        # The rounds the run committed, as its nodes read them (forgeries ahead skipped).
        head = len(await store.record_rounds())
        targets = await self._targets(head)
        if not targets:
            return
        rng = chaos.rng
        round = head + rng.randint(0, 3)
        names = [f"ghost-{rng.randint(0, 9)}", *(HONEST if chaos.signed else ())]
        snapshot = Snapshot(
            learner=rng.choice(names),
            round=round,
            fragment=keys.fragment_of(round, GC.fragments),
            base_version=max(keys.version_of(round, GC.fragments) - 1, 0),
            steps=4,
            tokens=16,
            parts=tuple(SnapshotPart(delta=ref, rows=()) for ref in rng.sample(targets, 2)),
            norm=None,
        )
        if rng.random() < 0.5:
            whole = rng.choice(targets)
            snapshot = msgspec.structs.replace(snapshot, delta=whole, parts=msgspec.UNSET)
        key = keys.snapshot(round, snapshot.learner)
        if await chaos.write(key, _forged(chaos, key, snapshot, manifest)):
            self.ledger.planted.append((round, {ref.sha256 for ref in snapshot.blobs}))
        await self._record(chaos, manifest, head, targets)

    async def _record(
        self, chaos: Chaos, manifest: Manifest, head: int, targets: list[BlobRef]
    ) -> None:
        """A record naming three of ``targets``: behind the record of a committed round, or
        ahead (misfiled in an unsigned run, where a well-formed one would be the truth)."""
        rng = chaos.rng
        round = max(head + rng.randint(-4, 3), 0)
        theta, outer, update = (rng.choice(targets) for _ in range(3))
        record = _record(round, GC.fragments, "mallory", update)
        record = msgspec.structs.replace(record, theta=theta, outer=outer)
        if round < head:
            key = keys.record_slot(round, rng.randint(1, 3))
        else:
            key = keys.record_slot(round, rng.randint(0, 3))
            if not chaos.signed:
                record = msgspec.structs.replace(record, round=round + 1)
        await chaos.write(key, _forged(chaos, key, record, manifest))

    async def _targets(self, head: int) -> list[BlobRef]:
        """The blobs of the committed records that round ``head + keep_rounds`` (when a
        round planted at ``head`` is collected) retains, thrice over, and the deltas their
        momentum replays from (read again when ``head`` moves)."""
        if self.targets[0] == head:
            return self.targets[1]
        store = self.ledger.store
        kept = retained(head + GC.keep_rounds, GC)
        refs: list[BlobRef] = []
        for round in sorted(r for r in kept.records if r < head):
            if (record := await store.record(round)) is None:
                continue
            refs.extend(3 * [ref for ref in (record.theta, record.outer, record.update) if ref])
            if round in kept.snapshots:
                counted = {p.learner for p in record.participants}
                for snapshot, problem in await store.snapshots(round):
                    if problem is None and snapshot.learner in counted:
                        refs.extend(snapshot.blobs)
        self.targets = (head, refs)
        return refs


def _forged(chaos: Chaos, key: str, obj: Snapshot | RoundRecord, manifest: Manifest) -> bytes:
    """``obj`` as planted at ``key``: plain in an unsigned run; in a signed one unsigned or
    signed with another key for this run."""
    if chaos.signed and chaos.rng.random() < 0.5:
        return records.encode(OTHER_KEY.sign(key, obj, manifest.run_id))
    return records.encode(obj)


async def _blob(store: Store, ref: BlobRef | None) -> bytes:
    assert ref is not None
    data = await store.get_blob(ref)
    assert data is not None, f"blob {ref.sha256} is gone"
    return data


def _same_bits(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))
        for x, y in zip(a, b, strict=True)
    )


async def _deltas(
    store: Store, record: RoundRecord, manifest: Manifest
) -> list[tuple[Snapshot, list[torch.Tensor]]]:
    """The verified snapshot of every participant of ``record``, with its delta decoded;
    asserts each is there with every blob it names."""
    spec = manifest.fragments[record.fragment]
    found = {s.learner: (s, problem) for s, problem in await store.snapshots(record.round)}
    out = []
    for participant in record.participants:
        assert participant.learner in found, (record.round, participant.learner)
        snapshot, problem = found[participant.learner]
        assert problem is None, (record.round, participant.learner, problem)
        datas = await store.delta_blobs(snapshot)
        assert datas is not None, (record.round, participant.learner)
        out.append((snapshot, tensors_of(open_delta(datas, snapshot, spec))))
    return out


async def _check_checkpoint(
    reader: RunReader, manifest: Manifest, record: RoundRecord, with_momentum: bool
) -> None:
    """The version before ``record``'s checkpoint (``RunReader.rebuild``, from the one
    below) stepped by hand through ``record``'s update is the checkpoint's θ bit for bit;
    ``with_momentum`` (its round's snapshots are kept: collection drops a checkpoint
    round's once it leaves the newest ``keep_rounds``, since replays start there) through
    its participants' deltas too, and then the momentum is the checkpoint's as well."""
    store, spec = reader.store, manifest.fragments[record.fragment]
    config = manifest.config
    before = await reader.rebuild(record.fragment, record.version - 1, momentum=with_momentum)
    assert before is not None, record.round
    mean = None
    if with_momentum:
        mean = mean_of(record, await _deltas(store, record, manifest), spec, config)
    update = await _blob(store, record.update)
    theta, momentum = replayed(before.theta, before.momentum, update, spec, config, mean=mean)
    assert _same_bits(theta, decode_fragment(await _blob(store, record.theta), spec))
    if with_momentum:
        assert momentum is not None
        assert _same_bits(momentum, decode_fragment(await _blob(store, record.outer), spec))


async def _needed(store: Store, manifest: Manifest, found: list[RoundRecord]) -> set[str]:
    """The blobs that Θ⁰ and the records retained after the newest of ``found`` name,
    asserting each is there, and so is every delta of their rounds that are kept."""
    kept = retained(found[-1].round, manifest.config)
    needed = {ref.sha256 for ref in manifest.theta0}
    for round in sorted(kept.records):
        record = found[round]
        for ref in (record.theta, record.outer, record.update):
            if ref is not None:
                await _blob(store, ref)
                needed.add(ref.sha256)
        if round in kept.snapshots:
            await _deltas(store, record, manifest)
    return needed


async def assert_retained_replay(
    box: MemoryMailbox, run_key: RunKey | None
) -> tuple[list[RoundRecord], set[str]]:
    """Nothing a retained record or kept snapshot needs is gone; every retained version
    (``checkpoint.retained`` after the newest round) rebuilds with its momentum; every
    retained checkpoint is the replay of the version before it (and its momentum, where
    its round's snapshots are kept: at least once). Returns the history and the blobs the
    retained records and Θ⁰ name."""
    store = Store(box, run_key=run_key)
    manifest = await store.manifest()
    assert manifest is not None
    config = manifest.config
    found = await history(box, run_key)
    needed = await _needed(store, manifest, found)
    kept = retained(found[-1].round, config)
    reader = RunReader(store)
    momentums = 0
    for fragment in range(config.fragments):
        newest = max(r.version for r in found if r.fragment == fragment)
        oldest = max(newest - config.keep_versions + 1, 0)
        for version in range(oldest, newest + 1):
            rebuilt = await reader.rebuild(fragment, version, momentum=True)
            assert rebuilt is not None, (fragment, version)
            assert all(bool(torch.isfinite(t).all()) for t in rebuilt.theta), (fragment, version)
        checkpoints = [
            found[keys.round_of(fragment, version, config.fragments)]
            for version in range(base(oldest, config) + 1, newest + 1)
            if is_checkpoint(version, config)
        ]
        assert checkpoints, (fragment, oldest, newest)
        for record in checkpoints:
            with_momentum = record.round in kept.snapshots
            await _check_checkpoint(reader, manifest, record, with_momentum)
            momentums += with_momentum
    assert momentums > 0
    return found, needed


def assert_no_shared_blobs(found: list[RoundRecord]) -> None:
    """No two rounds' records name one blob: equal payloads of two rounds (the zero update
    of rounds that closed empty) are two blobs, so collecting one round's never takes a blob
    a round being committed names."""
    owner: dict[str, int] = {}
    for record in found:
        for ref in (record.theta, record.outer, record.update):
            if ref is not None:
                assert owner.setdefault(ref.sha256, record.round) == record.round, (
                    ref.sha256,
                    owner[ref.sha256],
                    record.round,
                )


async def _join_and_train(box: MemoryMailbox, run_key: str | None) -> None:
    """A new learner joins the run as it stands: it holds the newest θ and steps on."""
    model = tiny_model(9)
    async with gradientmail.node(
        model, box, learner="late", config=GC, options=FAST, run_key=run_key
    ) as node:
        assert_weights(model, await newest_theta(box, RunKey(run_key) if run_key else None))
        trainer = Trainer(model, 9)
        with anyio.fail_after(30):
            for _ in range(8):
                trainer.step()
                await node.step(tokens=16)
        assert node.state.steps == 8


async def gc_under_chaos(signed: bool, target: int, limit: float) -> None:
    """The run of the module docstring, trained to ``target`` within ``limit`` seconds."""
    run_key = RunKey(SECRET) if signed else None
    box = Ledger(run_key)
    chaos = Chaos(box, signed, seed=38 + signed)
    if signed:
        chaos.replays = await _replays()
    for _ in range(40):  # before the run exists: the manifest's and creation's keys too
        await ATTACKS["junk"](chaos)
    await run_under_chaos(chaos, [*ATTACKS.values(), Bait(box)], GC, target, limit, burst=2)
    assert chaos.written >= 100, chaos.written
    found, needed = await assert_retained_replay(box, run_key)
    assert_no_shared_blobs(found)
    assert box.passes >= target // 2, (box.passes, found[-1].round)
    assert box.deleted - needed, "collection deleted no blob"
    assert not box.retained_deleted, sorted(box.retained_deleted)
    assert not box.deleted & needed, sorted(box.deleted & needed)
    assert box.threats > 0, "no planted snapshot named a retained blob when it was collected"
    await _join_and_train(box, SECRET if signed else None)


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
async def test_gc_under_chaos(signed: bool) -> None:
    await gc_under_chaos(signed, target=24, limit=60)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("GRADIENTMAIL_SOAK") != "1", reason="the full soak runs with GRADIENTMAIL_SOAK=1"
)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
async def test_gc_soak_full(signed: bool) -> None:
    await gc_under_chaos(signed, target=120, limit=280)
