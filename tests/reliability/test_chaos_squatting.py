"""Squatting: a junk object at a create-once key (a round's record, the manifest,
a claim) stalls nothing. Every honest store skips it for the same successor key, so
create-once still settles races among honest nodes; and in a signed run whatever was
signed for another run (same key, another run id) is junk too. Store-level, no timing."""

import os
from pathlib import Path

import msgspec
import pytest

from gradientmail.errors import RecordError, RunMismatch, StoreTampered
from gradientmail.mailbox import LocalMailbox, Mailbox, MemoryMailbox
from gradientmail.mailbox.local import key_path
from gradientmail.protocol import keys, records
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    Manifest,
    ParamSpec,
    Participant,
    RoundClaim,
    RoundRecord,
    RunConfig,
)
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

pytestmark = pytest.mark.anyio

KEY = RunKey("squatting tests, a long enough secret")
REF = BlobRef(sha256="ab" * 32, size=12, encoding="fp32")
SPEC = FragmentSpec(index=0, params=(ParamSpec(name="w", shape=(3,), dtype="float32"),))
MANIFEST = Manifest(
    created_by="a",
    config=RunConfig(fragments=2, sync_every=4),
    fragments=(SPEC, FragmentSpec(index=1, params=SPEC.params)),
    theta0=(REF, REF),
)
DEEP = b"[" * 1000 + b"]" * 1000
JUNK = {
    "random bytes": b"\x8f\x00junk\xff",
    "deep nesting": DEEP,
    "deep inside an object": b'{"format":1,"round":' + DEEP + b"}",
    "huge number": b'{"format":1,"round":' + b"9" * 400 + b"}",
    "empty object": b"{}",
}


def record(round: int, by: str) -> RoundRecord:
    return RoundRecord(
        round=round,
        fragment=round % 2,
        version=round // 2 + 1,
        committed_by=by,
        participants=(Participant(learner=by, weight=1.0, steps=1, tokens=1, base_version=0),),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        theta=REF,
        outer=REF,
        update=REF,
    )


async def _run(box: Mailbox, run_key: RunKey | None = None) -> list[Store]:
    """Three honest stores of one run in ``box``, each having read the manifest."""
    stores = [Store(box, run_key=run_key) for _ in range(3)]
    await stores[0].create_manifest(MANIFEST)
    for store in stores[1:]:
        assert await store.manifest() is not None
    return stores


@pytest.mark.parametrize("what", sorted(JUNK))
@pytest.mark.parametrize("signed", [False, True])
async def test_junk_at_a_record_key_moves_every_honest_node_to_the_same_successor(
    what: str, signed: bool
) -> None:
    box = MemoryMailbox()
    a, b, reader = await _run(box, KEY if signed else None)
    await box.put_if_absent(keys.record(0), JUNK[what])
    await box.put_if_absent(keys.record_slot(0, 1), JUNK[what])
    assert await reader.record(0) is None
    assert await reader.record_rounds() == []
    ours, mine = await a.put_record(record(0, "a"))
    assert mine
    theirs, won = await b.put_record(record(0, "b"))
    assert not won
    assert theirs == ours
    found = await reader.record(0)
    assert found is not None
    assert found.committed_by == "a"
    assert await reader.record_rounds() == [0]
    assert await box.get(keys.record_slot(0, 2)) is not None
    assert {keys.record(0), keys.record_slot(0, 1)} <= set(reader.ignored)


async def test_a_record_that_names_another_round_is_junk() -> None:
    box = MemoryMailbox()
    a, reader, _ = await _run(box)
    for round in range(3):
        await a.put_record(record(round, "a"))
    await box.put_if_absent(keys.record(3), records.encode(record(1, "mallory")))
    assert await reader.record(3) is None
    landed, mine = await a.put_record(record(3, "a"))
    assert mine
    assert landed.committed_by == "a"


async def test_an_unsigned_claim_proves_an_overwrite_only_when_a_committer_made_it() -> None:
    """Junk at the first key of the round being committed, read before, and a claim on the
    round after it: in an unsigned run the claim shows the record was overwritten only when
    it names a learner that committed a round the store took. One naming a learner that only
    took part (anyone's well-formed snapshot takes part) proves nothing: the record goes to
    a successor key."""
    box = MemoryMailbox()
    a, _, _ = await _run(box)
    await a.put_record(msgspec.structs.replace(record(0, "ghost"), committed_by="a"))
    for round, claimant in ((1, "ghost"), (2, "a")):
        await box.put_if_absent(keys.record(round), JUNK["random bytes"])
        assert await a.record(round) is None
        claim = records.encode(RoundClaim(learner=claimant))
        await box.put_if_absent(keys.round_claim(round + 1, 0), claim)
    _, mine = await a.put_record(record(1, "a"))
    assert mine
    assert await box.get(keys.record_slot(1, 1)) is not None
    with pytest.raises(StoreTampered, match=keys.record(2)):
        await a.put_record(record(2, "a"))


async def test_junk_far_ahead_is_foreign_to_the_listing() -> None:
    box = MemoryMailbox()
    a, reader, _ = await _run(box)
    await a.put_record(record(0, "a"))
    await box.put_if_absent(keys.record(10**10 - 1), records.encode(record(10**10 - 1, "m")))
    await box.put_if_absent(keys.record(5), records.encode(record(5, "m")))
    assert await reader.record_rounds() == [0]
    assert await reader.record_rounds(after=0) == []


@pytest.mark.parametrize("what", sorted(JUNK))
async def test_junk_at_the_manifest_key_moves_creation_to_its_successor(what: str) -> None:
    box = MemoryMailbox()
    await box.put_if_absent(keys.MANIFEST, JUNK[what])
    creator, joiner = Store(box, run_key=KEY), Store(box, run_key=KEY)
    assert await joiner.manifest() is None
    created = await creator.create_manifest(MANIFEST)
    assert isinstance(created.run_id, str)
    assert len(created.run_id) == 32
    assert await joiner.manifest() == created
    assert await Store(box, run_key=KEY).create_manifest(MANIFEST) == created


async def test_a_keyless_manifest_with_the_runs_key_id_is_junk_to_the_key_holder() -> None:
    box = MemoryMailbox()
    forged = msgspec.structs.replace(MANIFEST, key_id=KEY.key_id, created_by="mallory")
    await box.put_if_absent(keys.MANIFEST, records.encode(forged))
    created = await Store(box, run_key=KEY).create_manifest(MANIFEST)
    assert created.created_by == "a"
    assert await box.get(keys.manifest_slot(1)) is not None


async def test_a_well_formed_manifest_of_another_kind_of_run_is_refused_not_skipped() -> None:
    box = MemoryMailbox()
    await Store(box).create_manifest(MANIFEST)
    with pytest.raises(RunMismatch, match="not signed"):
        await Store(box, run_key=KEY).manifest()


async def test_a_signed_runs_objects_do_not_verify_in_another_run_with_the_same_key() -> None:
    """Run A's signed record (and its blobs) copied into run B, which shares
    A's key, under the very key it had in A: B refuses it and commits its own."""
    run_a, run_b = MemoryMailbox(), MemoryMailbox()
    (a, *_) = await _run(run_a, KEY)
    (b, reader, _) = await _run(run_b, KEY)
    manifest_a, manifest_b = await a.manifest(), await b.manifest()
    assert manifest_a is not None
    assert manifest_b is not None
    assert manifest_a.run_id != manifest_b.run_id
    blob = b"theta of run A"
    ref = await a.put_blob(blob, "fp32")
    signed_a, _ = await a.put_record(msgspec.structs.replace(record(0, "a"), theta=ref))
    for key in await run_a.list(""):
        if key.startswith((keys.RECORDS, keys.BLOBS, keys.ROUNDS)):
            data = await run_a.get(key)
            assert data is not None
            await run_b.put_if_absent(key, data)
    copied = await run_b.get(keys.record(0))
    assert copied is not None
    assert KEY.check(keys.record(0), copied, manifest_a.run_id) is None
    assert KEY.check(keys.record(0), copied, manifest_b.run_id) == "bad-signature"
    assert await reader.record(0) is None
    assert await reader.record_rounds() == []
    ours, mine = await b.put_record(record(0, "b"))
    assert mine
    found = await reader.record(0)
    assert found == ours
    assert found.committed_by == "b"
    assert found != signed_a


async def test_a_claim_far_ahead_is_foreign_and_claims_stay_in_the_layout() -> None:
    """A claim planted at the last number is foreign: the next claim's key stays in the
    layout, and claiming past the last number raises ``RecordError``."""
    box = MemoryMailbox()
    a, reader, _ = await _run(box)
    await box.put_if_absent(
        keys.round_claim(2, keys.SLOTS - 1), records.encode(RoundClaim(learner="m"))
    )
    await box.put_if_absent(keys.create_claim(keys.SLOTS - 1), b"{}")
    assert await reader.round_claims(2) == []
    assert await reader.create_claims() == []
    await box.put_if_absent(keys.round_claim(2, 0), DEEP)
    assert await reader.round_claims(2) == [(0, "")]
    assert await a.claim_round(2, 1, "a")
    assert await reader.round_claims(2) == [(0, ""), (1, "a")]
    with pytest.raises(RecordError, match="flooding"):
        await a.claim_round(2, keys.SLOTS, "a")
    with pytest.raises(RecordError, match="flooding"):
        await a.claim_creation(keys.SLOTS, "a")


def test_successor_keys_sort_after_their_first_and_before_the_next_round() -> None:
    assert keys.record(4) < keys.record_slot(4, 1) < keys.record_slot(4, 9999) < keys.record(5)
    assert keys.parse_record_slot(keys.record_slot(4, 7)) == (4, 7)
    assert keys.parse_record_slot(keys.record(4)) == (4, 0)
    for foreign in ("records/0000000004.0000", "records/0000000004.1", "records/0000000004."):
        assert keys.parse_record_slot(foreign) is None
    assert keys.manifest_slot(0) == keys.MANIFEST
    assert keys.manifest_slot(3) == "manifest.0003"


async def test_an_object_the_mailbox_refuses_unread_is_junk(tmp_path: Path) -> None:
    """An object over the record limit (a 256 MiB one, a symlink to /dev/zero) at a record
    key is not read whole: the store asks for at most the record limit and skips what the
    mailbox refuses."""
    async with LocalMailbox(tmp_path / "run") as box:
        a, reader, _ = await _run(box)
        await box.put_if_absent(keys.record(0), b"x" * (records.MAX_RECORD_BYTES + 1))
        await box.put_if_absent(keys.record_slot(0, 1), b"placeholder")
        link = tmp_path / "run" / "objects" / Path(*key_path(keys.record_slot(0, 2)))
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/dev/zero", link)
        assert await reader.record(0) is None
        landed, mine = await a.put_record(record(0, "a"))
        assert mine
        assert await box.get(keys.record_slot(0, 3)) is not None
        found = await reader.record(0)
        assert found == landed
        assert keys.record(0) in reader.ignored
