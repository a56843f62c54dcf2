"""The chaos writer: while three learners and a syncer-only node train on one
``MemoryMailbox``, a hostile task writes hundreds of objects into every key space of the
layout. Each family of attack runs on its own, in an unsigned and a signed run, on both
event loops.

Pass: no node raises, rounds keep committing (every learner reaches the target round),
every committed θ is finite; in a signed run nobody but the honest learners takes part in a
round (in an unsigned run a well-formed snapshot cannot be told from an honest one), and
recomputing every fragment from Θ⁰ through the updates of the committed
records gives exactly each record's θ, and every one of those records and of their
participants' snapshots verifies under the run key and the run's id.

Families:

- ``junk``: random bytes, JSON nested 1,000 deep, 1.5 MiB objects and out-of-range numbers
  at the manifest, ``create/``, ``init/``, ``leases/`` (for ghosts and for a live learner,
  up to the last beat number), claims (up to the last claim number), snapshots, records
  (the next rounds' keys and their successors) and ``blobs/``.
- ``forgeries``: well-formed records of the next rounds whose blobs do not exist, signed by
  nobody (signed run) or misfiled under another round (unsigned run); and, in the signed
  run, replays of another run's objects signed with the same key (records, snapshots,
  claims, beats) under the keys of this run.
- ``deltas``: well-formed snapshots from ghost learners with non-finite (NaN, inf) and huge
  finite (3e38) deltas, heavy token counts, blobs that exist.
"""

import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import anyio
import msgspec
import pytest
import torch
from reliability_helpers import CONFIG, FAST, Trainer, tiny_model

import gradientmail
from gradientmail.mailbox import MemoryMailbox
from gradientmail.protocol import keys, records
from gradientmail.protocol.codec import decode_fragment, encode_fragment
from gradientmail.protocol.fragments import signature, window
from gradientmail.protocol.outer import apply_update
from gradientmail.protocol.records import (
    BlobRef,
    Manifest,
    RoundClaim,
    RoundRecord,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store, sha256

pytestmark = pytest.mark.anyio

SECRET = "chaos tests share this run key with the replayed run"
HONEST = ("a", "b", "c")
TARGET = 5
"""Every learner trains until it holds a version committed by this round or a later one."""
CHAOS = msgspec.structs.replace(CONFIG, keep_rounds=10_000, keep_versions=10_000)
"""Nothing is collected, so the check can replay every record."""
DEEP = b"[" * 1000 + b"]" * 1000
HUGE = b'{"format":1,"pad":"' + b"x" * (3 << 19) + b'"}'


def _junk(rng: random.Random) -> bytes:
    return rng.choice(
        [
            rng.randbytes(rng.randint(0, 64)),
            DEEP,
            b'{"format":1,"learner":' + DEEP + b"}",
            b'{"format":1,"round":' + b"9" * 400 + b"}",
            b'{"format":1,"round":-1,"fragment":1e999}',
            HUGE,
            b"{}",
        ]
    )


class Chaos:
    """The hostile writer's view of the run: where it is now, and what it may replay."""

    def __init__(self, box: MemoryMailbox, signed: bool, seed: int) -> None:
        self.box = box
        self.signed = signed
        self.rng = random.Random(seed)
        self.written = 0
        self.replays: list[tuple[str, bytes]] = []

    async def write(self, key: str, data: bytes) -> bool:
        """Whether ``data`` landed at ``key`` (False: something else was there)."""
        landed = await self.box.put_if_absent(key, data)
        self.written += landed
        return landed

    async def next_round(self) -> int:
        """The first round without a record, as the run sees it (junk ahead ignored)."""
        rounds = await Store(self.box, unverified=True).record_rounds()
        return len(rounds)

    async def manifest(self) -> Manifest | None:
        store = Store(self.box, unverified=True, run_key=RunKey(SECRET) if self.signed else None)
        return await store.manifest()


async def _junk_everywhere(chaos: Chaos) -> None:
    rng = chaos.rng
    head = await chaos.next_round()
    ghost = f"ghost-{rng.randint(0, 9)}"
    choices = [
        keys.manifest_slot(rng.randint(0, 3)),
        keys.create_claim(rng.choice([0, 1, 2, keys.SLOTS - 1])),
        keys.init_marker(rng.randint(0, 2), rng.randint(0, 3)),
        keys.lease(ghost, rng.randint(0, 10**12 - 1), "learner"),
        keys.lease(rng.choice(HONEST), rng.choice([10**6, 10**12 - 1]), "learner"),
        keys.round_claim(head + rng.randint(0, 3), rng.choice([0, 1, 2, keys.SLOTS - 1])),
        keys.snapshot(head + rng.randint(0, 3), ghost),
        keys.record_slot(head + rng.randint(0, 3), rng.randint(0, 2)),
        keys.record(rng.choice([10**10 - 1, head + 50])),
        keys.blob(sha256(rng.randbytes(8))),
    ]
    await chaos.write(rng.choice(choices), _junk(rng))


async def _forgeries(chaos: Chaos) -> None:
    rng = chaos.rng
    manifest = await chaos.manifest()
    if manifest is None:
        return
    head = await chaos.next_round()
    round = head + rng.randint(0, 5)
    fragments = manifest.config.fragments
    missing = BlobRef(sha256=sha256(rng.randbytes(8)), size=64, encoding="fp32")
    forged = _record(round, fragments, "mallory", missing)
    if not chaos.signed:
        # A well-formed record of the right round is a forgery an unsigned run cannot tell
        # from the truth (docs/reliability.md): here it names another round.
        forged = msgspec.structs.replace(forged, round=round + 1)
    slot = keys.record_slot(round, rng.randint(0, 5))
    if rng.random() < 0.5:
        await chaos.write(slot, records.encode(forged))
    else:
        # Valid-looking but with a hash that is no hash.
        await chaos.write(slot, records.encode(forged).replace(missing.sha256.encode(), b"f" * 63))
    claim = records.encode(RoundClaim(learner=f"ghost-{rng.randint(0, 9)}"))
    await chaos.write(keys.round_claim(round, rng.randint(0, 3)), claim)
    if chaos.replays:
        key, data = rng.choice(chaos.replays)
        await chaos.write(_here(key, head, rng), data)


def _record(round: int, fragments: int, by: str, ref: BlobRef) -> RoundRecord:
    """A record of ``round`` with no participants whose three blobs are ``ref``."""
    return RoundRecord(
        round=round,
        fragment=keys.fragment_of(round, fragments),
        version=keys.version_of(round, fragments),
        committed_by=by,
        participants=(),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        theta=ref,
        outer=ref,
        update=ref,
    )


def _here(key: str, head: int, rng: random.Random) -> str:
    """``key`` of the other run moved to a round near this run's ``head``."""
    round = head + rng.randint(0, 2)
    if (parsed := keys.parse_record_slot(key)) is not None:
        return keys.record_slot(round, parsed[1])
    if (snapshot := keys.parse_snapshot(key)) is not None:
        return keys.snapshot(round, snapshot[1])
    if (claim := keys.parse_claim(key)) is not None:
        return keys.round_claim(round, claim[1])
    return key


async def _bad_deltas(chaos: Chaos) -> None:
    rng = chaos.rng
    manifest = await chaos.manifest()
    if manifest is None:
        return
    head = await chaos.next_round()
    round = head + rng.randint(0, 2)
    fragment = keys.fragment_of(round, manifest.config.fragments)
    spec = manifest.fragments[fragment]
    value = rng.choice([math.nan, math.inf, 3e38, -3e38, 1e30])
    delta = [torch.full(p.shape, value) for p in spec.params]
    data = encode_fragment(delta, spec, "fp32", block_size=1)
    key = keys.blob(sha256(data))
    await chaos.write(key, data)
    learner = f"ghost-{rng.randint(0, 99)}"
    snapshot = Snapshot(
        learner=learner,
        round=round,
        fragment=fragment,
        base_version=max(keys.version_of(round, manifest.config.fragments) - 1, 0),
        steps=4,
        tokens=rng.choice([16, 4 * CHAOS.max_tokens_per_step]),
        delta=BlobRef(sha256=sha256(data), size=len(data), encoding="fp32"),
        norm=None,
    )
    await chaos.write(keys.snapshot(round, learner), records.encode(snapshot))


Attack = Callable[[Chaos], Awaitable[None]]
"""A family of hostile objects: each call writes (at most) a few of them."""
ATTACKS: dict[str, Attack] = {
    "junk": _junk_everywhere,
    "forgeries": _forgeries,
    "deltas": _bad_deltas,
}


async def _replays() -> list[tuple[str, bytes]]:
    """Objects of another run signed with the same key (so with another run id): a record,
    a snapshot, a claim and a lease beat, as that run's own store wrote them."""
    other = MemoryMailbox()
    store = Store(other, run_key=RunKey(SECRET))
    model = tiny_model(7)
    named = list(model.named_parameters())
    specs = signature(named, CHAOS.fragments, CHAOS.pattern)
    by_name = dict(named)
    theta0 = []
    for spec in specs:
        data = encode_fragment(
            [window(by_name[p.name], p).detach() for p in spec.params], spec, "fp32", block_size=1
        )
        theta0.append(await store.put_blob(data, "fp32"))
    manifest = await store.create_manifest(
        Manifest(created_by="a", config=CHAOS, fragments=specs, theta0=tuple(theta0))
    )
    for round in range(4):
        ref = manifest.theta0[round % CHAOS.fragments]
        await store.put_record(_record(round, CHAOS.fragments, "a", ref))
        await store.put_snapshot(
            Snapshot(
                learner="a",
                round=round,
                fragment=round % CHAOS.fragments,
                base_version=round // CHAOS.fragments,
                steps=4,
                tokens=16,
                delta=ref,
                norm=None,
            )
        )
        await store.claim_round(round, 0, "a")
        await store.beat("a", 10**6 + round, "learner")
    return [(key, await other.get(key) or b"") for key in await other.list("")]


async def _check(box: MemoryMailbox, signed: bool) -> list[RoundRecord]:
    run_key = RunKey(SECRET) if signed else None
    store = Store(box, run_key=run_key)
    manifest = await store.manifest()
    assert manifest is not None
    rounds = await store.record_rounds()
    assert rounds == list(range(len(rounds)))
    found = [record for round in rounds if (record := await store.record(round)) is not None]
    assert len(found) == len(rounds)
    thetas = {}
    for fragment, spec in enumerate(manifest.fragments):
        data = await store.get_blob(manifest.theta0[fragment])
        assert data is not None
        thetas[fragment] = decode_fragment(data, spec)
    for record in found:
        if signed:
            assert {p.learner for p in record.participants} <= set(HONEST), record
        spec = manifest.fragments[record.fragment]
        update = await store.get_blob(record.update)
        assert update is not None
        committed = apply_update(thetas[record.fragment], update, spec)
        if record.theta is not None:  # a checkpoint: θ as stored is the replay
            data = await store.get_blob(record.theta)
            assert data is not None
            stored = decode_fragment(data, spec)
            assert all(torch.equal(x, y) for x, y in zip(stored, committed, strict=True))
        assert all(bool(torch.isfinite(t).all()) for t in committed), record.round
        if signed:
            # Each participant's snapshot, at whichever of its keys the squatting left it,
            # verifies under the key and this run's id.
            checked = {s.learner: problem for s, problem in await store.snapshots(record.round)}
            for p in record.participants:
                assert checked[p.learner] is None, (record.round, p.learner)
        thetas[record.fragment] = committed
    return found


async def run_under_chaos(
    chaos: Chaos,
    attacks: Sequence[Attack],
    config: RunConfig,
    target: int,
    limit: float = 60,
    burst: int = 10,
) -> None:
    """Three honest learners and a syncer-only node train in ``chaos.box`` (signed with
    ``SECRET`` when ``chaos.signed``) until every learner holds a version committed by
    ``target`` or a later round, each within ``limit`` seconds, while each of ``attacks``
    writes ``burst`` times between short pauses. Any node's failure is raised."""
    run_key = SECRET if chaos.signed else None
    learners_done = anyio.Event()

    async def hostile() -> None:
        while not learners_done.is_set():
            for _ in range(burst):
                for attack in attacks:
                    await attack(chaos)
            await anyio.sleep(0.005)

    async def learner(index: int, name: str) -> None:
        model = tiny_model(index)
        async with gradientmail.node(
            model, chaos.box, learner=name, config=config, options=FAST, run_key=run_key
        ) as node:
            trainer = Trainer(model, index)
            with anyio.fail_after(limit):
                while node.state.round < target:
                    trainer.step()
                    await node.step(tokens=16)
                    await anyio.sleep(0.002)

    async def syncer_only() -> None:
        options = replace(FAST, syncer=True)
        async with gradientmail.node(
            None, chaos.box, learner="s", config=config, options=options, run_key=run_key
        ):
            await learners_done.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hostile)
        tg.start_soon(syncer_only)
        async with anyio.create_task_group() as learners:
            for index, name in enumerate(HONEST):
                learners.start_soon(learner, index, name)
        learners_done.set()


@pytest.mark.parametrize(
    ("attack", "signed"),
    [
        ("junk", False),
        ("junk", True),
        ("forgeries", False),
        ("forgeries", True),
        ("deltas", False),
        ("deltas", True),
    ],
)
async def test_a_run_survives_a_hostile_writer(attack: str, signed: bool) -> None:
    box = MemoryMailbox()
    chaos = Chaos(box, signed, seed=sum(map(ord, attack)) + signed)
    if signed and attack == "forgeries":
        chaos.replays = await _replays()
    if attack == "junk":
        # Before the run exists: the manifest's and creation's keys too.
        for _ in range(40):
            await _junk_everywhere(chaos)
    await run_under_chaos(chaos, [ATTACKS[attack]], CHAOS, TARGET)
    assert chaos.written >= 100, chaos.written
    found = await _check(box, signed)
    assert len(found) > TARGET
