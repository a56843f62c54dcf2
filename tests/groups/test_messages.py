"""The control messages of a learner group (``protocol.group``), without a process group:
summing contributions as an all-reduce would, and the verdict every rank reaches."""

from typing import get_args

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.protocol.group import (
    Decision,
    Gathered,
    Message,
    PartReport,
    all_ready,
    contribution,
    decode_log,
    encode_log,
    read,
    verdict,
    width,
)
from gradientmail.protocol.learner_inputs import (
    BeganClosing,
    DownloadFailed,
    DroppedAll,
    Finalized,
    Flushed,
    Input,
    PublishEnded,
    RecordSeen,
    Stepped,
    Synced,
    VersionReady,
    without_tensors,
)
from gradientmail.protocol.records import BlobRef, RoundRecord, SnapshotPart


def summed(messages: list[Message], fragments: int) -> list[int]:
    total = [0] * width(fragments)
    for message in messages:
        total = [a + b for a, b in zip(total, contribution(message, fragments), strict=True)]
    return total


@given(
    world=st.integers(1, 8),
    tokens=st.integers(0, 10**9),
    versions=st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
    round=st.integers(-1, 10**6),
    aligned=st.integers(-1, 10**6),
    ok=st.booleans(),
)
def test_a_step_carries_the_leaders_decision_to_every_rank(
    world: int, tokens: int, versions: list[int], round: int, aligned: int, ok: bool
) -> None:
    fragments = len(versions)
    decision = Decision(tuple(versions), round, aligned, tokens, ok)
    messages = [
        Message("step", rank, tokens=tokens, decision=decision if rank == 0 else None)
        for rank in range(world)
    ]
    result = read(summed(messages, fragments), fragments)
    assert result.tokens == world * tokens
    assert result.decision == decision
    assert verdict(result, "step", world) is None


def test_ranks_that_pass_different_tokens_fail_the_step() -> None:
    decision = Decision((1, 2), 3, 3, tokens=32)
    messages = [Message("step", 0, 32, decision), Message("step", 1, 16)]
    problem = verdict(read(summed(messages, 2), 2), "step", 2)
    assert problem is not None
    assert "different tokens to step(): 48 in all, the leader 32" in problem


def test_an_abort_completes_any_exchange_and_names_the_rank() -> None:
    messages = [Message("step", 0, tokens=3), Message("abort", 2), Message("step", 1)]
    result = read(summed(messages, 2), 2)
    assert verdict(result, "step", 3) == "rank 2 of the group left the block with an exception"
    both = read(summed([Message("abort", 1), Message("abort", 2), Message("close", 0)], 2), 2)
    assert verdict(both, "close", 3) == "2 ranks of the group left the block with an exception"


def test_ranks_out_of_step_are_named() -> None:
    result = read(summed([Message("step", 0), Message("close", 1)], 1), 1)
    problem = verdict(result, "step", 2)
    assert problem is not None
    assert "expected 2 step, got 1 step, 1 close" in problem


def test_a_step_or_result_without_the_leaders_decision_fails() -> None:
    result = read(summed([Message("step", 0), Message("step", 1)], 1), 1)
    assert verdict(result, "step", 2) == "the leader (rank 0) sent no decision with its step"


def test_bad_contributions_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        contribution(Message("step", 0, tokens=-1), 2)
    with pytest.raises(ValueError, match="needs 2 versions"):
        contribution(Message("step", 0, decision=Decision((1,), 0, 0)), 2)
    with pytest.raises(ValueError, match=f"of 1 fragments has {width(1)} ints"):
        read([0] * 3, 1)
    two = Message("step", 0, decision=Decision((1,), 0, 0))
    with pytest.raises(ValueError, match="only the leader"):
        read(summed([two, two], 1), 1)


def test_changed_fragments_are_those_whose_version_moved() -> None:
    before = Decision((3, 4, 5), 10, 10)
    assert Decision((3, 5, 6), 12, 12).changed(before) == (1, 2)
    assert before.changed(before) == ()


@given(world=st.integers(1, 8), data=st.data())
def test_part_reports_are_counted_and_the_log_bytes_reach_every_rank(
    world: int, data: st.DataObject
) -> None:
    reports = [data.draw(st.booleans()) for _ in range(world)]
    log = data.draw(st.integers(0, 10**9))
    decision = Decision((0, 0), 0, 0, log=log, closing=data.draw(st.booleans()))
    messages = [
        Message("step", rank, decision=decision if rank == 0 else None, reports=reports[rank])
        for rank in range(world)
    ]
    result = read(summed(messages, 2), 2)
    assert result.reports == sum(reports)
    assert result.decision == decision
    assert verdict(result, "step", world) is None


def test_a_version_is_ready_once_every_rank_has_prepared_the_round_wanted() -> None:
    prepared = [(3, None, 7), (3, 5, 6), (3, 5, 7)]
    messages = [Message("step", rank, prepared=p) for rank, p in enumerate(prepared)]
    result = read(summed(messages, 3), 3)
    assert all_ready(result, [3, 5, 7], 3) == (0,)
    assert all_ready(result, [None, None, 6], 3) == ()
    assert all_ready(result, [3, None, 7], 2) == ()


@given(
    wanted=st.integers(-1, 10**6),
    prepared=st.lists(st.one_of(st.none(), st.integers(-1, 10**6)), min_size=1, max_size=8),
)
def test_readiness_is_exact_whatever_the_rounds(wanted: int, prepared: list[int | None]) -> None:
    messages = [Message("step", rank, prepared=(p,)) for rank, p in enumerate(prepared)]
    result = read(summed(messages, 1), 1)
    every = all((-1 if p is None else p) == wanted for p in prepared)
    assert all_ready(result, [wanted], len(prepared)) == ((0,) if every else ())


@given(now=st.floats(allow_nan=False), tokens=st.integers(0, 10**9))
def test_the_leader_step_reaches_every_rank_bit_for_bit(now: float, tokens: int) -> None:
    decision = Decision((0,), 0, 0, tokens, now=now)
    messages = [Message("step", 0, tokens, decision), Message("step", 1, tokens)]
    result = read(summed(messages, 1), 1)
    assert result.decision is not None
    assert result.decision.stepped == Stepped(tokens, now)


def test_negative_log_bytes_and_readiness_of_another_run_are_refused() -> None:
    with pytest.raises(ValueError, match="readiness of a 2-fragment run"):
        contribution(Message("step", 1, prepared=(1,)), 2)
    with pytest.raises(ValueError, match="non-negative"):
        contribution(Message("step", 0, decision=Decision((1,), 0, 0, log=-1)), 1)


def test_the_log_carries_every_input_of_the_leaders_learner() -> None:
    record = RoundRecord(
        round=3,
        fragment=1,
        version=1,
        committed_by="s",
        participants=(),
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        update=BlobRef(sha256="a" * 64, size=10, encoding="int8", index="b" * 64),
    )
    entries: list[Input] = [
        Stepped(tokens=32, now=1.5),
        Synced(now=1.6),
        RecordSeen(record=record, now=2.0),
        VersionReady(fragment=1, round=3),
        DownloadFailed(fragment=0, round=2, stage="update", failure="corrupt", detail="bad"),
        PublishEnded(fragment=1, round=5, ok=False),
        Flushed(now=3.0),
        BeganClosing(),
        Finalized(),
        DroppedAll(reason="gave-up", detail="why"),
    ]
    assert {type(entry) for entry in entries} == set(get_args(Input))  # every input
    assert decode_log(encode_log(entries)) == entries
    assert encode_log([]) == b""
    assert decode_log(b"") == []
    with pytest.raises(ValueError, match="does not decode"):
        decode_log(b'[{"type":"unknown"}]')


def test_the_log_carries_the_inputs_with_tensors_without_them() -> None:
    rows = (torch.ones(2),)
    fed: list[Input] = [VersionReady(1, 3, rows), BeganClosing((rows, rows))]
    logged = [without_tensors(entry) for entry in fed]
    assert logged == [VersionReady(1, 3), BeganClosing()]
    # Each rank's log decodes in every rank of the same version: the bytes name no tensor.
    data = b'[{"type":"ready","fragment":1,"round":3},{"type":"closing"}]'
    assert encode_log(logged) == data
    assert decode_log(data) == logged
    with pytest.raises(ValueError, match="does not decode"):
        decode_log(b'[{"type":"ready","fragment":1,"round":3,"theta":[1.0]}]')


def test_the_leader_writes_a_snapshot_once_every_rank_reported_its_part() -> None:
    def report(rank: int, squares: float | None) -> PartReport:
        ref = BlobRef(sha256=f"{rank}" * 64, size=8, encoding="fp32")
        rows = ((rank * 5, rank * 5 + 5),)
        return PartReport(rank, 7, 2, SnapshotPart(delta=ref, rows=rows), squares)

    gathered = Gathered.empty(3).add(report(2, 4.0)).add(report(0, 9.0))
    assert not gathered.complete
    with pytest.raises(ValueError, match=r"ranks \[1\] have not reported"):
        gathered.snapshot_parts()
    with pytest.raises(ValueError, match="twice"):
        gathered.add(report(2, 1.0))
    with pytest.raises(ValueError, match="outside a group of 3"):
        gathered.add(report(3, 1.0))
    done = gathered.add(report(1, 3.0))
    parts, norm = done.snapshot_parts()
    assert [part.rows for part in parts] == [((0, 5),), ((5, 10),), ((10, 15),)]
    assert norm == 4.0
    assert Gathered.empty(2).add(report(0, None)).add(report(1, 1.0)).snapshot_parts()[1] is None
