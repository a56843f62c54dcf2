"""The history's chain: which record binds which bytes, and which key a broken link blames."""

import hashlib
import itertools

import msgspec

from gradientmail.protocol import keys
from gradientmail.protocol.chain import Stored, link_problem, overwritten
from gradientmail.protocol.records import BlobRef, RoundRecord, decode, encode

MANIFEST = hashlib.sha256(b"the manifest's bytes").hexdigest()


def record(round: int, previous: str | None, update: str = "a") -> RoundRecord:
    return RoundRecord(
        round=round,
        fragment=0,
        version=round + 1,
        committed_by="alpha",
        participants=(),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        update=BlobRef(sha256=update * 64, size=4, encoding="fp32"),
        previous=msgspec.UNSET if previous is None else previous,
    )


def stored(r: RoundRecord, slot: int = 0) -> Stored:
    data = encode(r)
    return Stored(keys.record_slot(r.round, slot), hashlib.sha256(data).hexdigest(), r)


def chain(length: int) -> list[Stored]:
    taken = [stored(record(0, MANIFEST))]
    for round in range(1, length):
        taken.append(stored(record(round, taken[-1].digest)))
    return taken


def test_an_honest_chain_links_from_the_manifest() -> None:
    taken = chain(4)
    assert link_problem(taken[0], None, MANIFEST) is None
    for before, after in itertools.pairwise(taken):
        assert link_problem(after, before, MANIFEST) is None


def test_a_record_at_a_successor_key_links_by_the_bytes_there() -> None:
    first = stored(record(0, MANIFEST), slot=1)
    second = stored(record(1, first.digest))
    assert link_problem(second, first, MANIFEST) is None


def test_a_predecessor_overwritten_with_another_record_is_blamed() -> None:
    taken = chain(3)
    forged = stored(record(1, taken[0].digest, update="b"))
    assert link_problem(forged, taken[0], MANIFEST) is None, "the forgery itself chains"
    problem = link_problem(taken[2], forged, MANIFEST)
    assert problem is not None
    assert problem.key == keys.record(1)
    assert keys.record(2) in problem.why


def test_a_predecessor_overwritten_with_junk_is_blamed() -> None:
    taken = chain(3)
    problem = link_problem(taken[2], None, MANIFEST)
    assert problem is not None
    assert problem.key == keys.record(1)


def test_round_zero_binds_the_manifest() -> None:
    other = stored(record(0, hashlib.sha256(b"another manifest").hexdigest()))
    problem = link_problem(other, None, MANIFEST)
    assert problem is not None
    assert problem.key == keys.record(0)
    assert link_problem(other, None, None) is None, "nothing to check before the manifest"


def test_records_written_before_the_field_still_read_and_encode_without_it() -> None:
    old = record(1, None)
    assert b"previous" not in encode(old)
    assert decode(encode(old), RoundRecord) == old
    assert link_problem(stored(old), stored(record(0, None)), MANIFEST) is None
    assert link_problem(stored(record(0, None)), None, MANIFEST) is None
    new = record(2, stored(old).digest)
    assert link_problem(stored(new), stored(old), MANIFEST) is None


def test_a_missing_predecessor_breaks_even_an_old_record() -> None:
    problem = link_problem(stored(record(3, None)), None, MANIFEST)
    assert problem is not None
    assert problem.key == keys.record(2)


def test_junk_at_a_round_whose_next_round_is_claimed_is_an_overwrite() -> None:
    problem = overwritten(5, first_key_junk=True, next_claimed=True, has_record=False)
    assert problem is not None
    assert problem.key == keys.record(5)
    assert "round 6 was claimed" in problem.why
    for facts in itertools.product([False, True], repeat=3):
        if facts != (True, True, False):
            assert overwritten(5, *facts) is None, facts
