"""The pure learner (``protocol.learner.Learner``), driven without I/O, and proof that the
node runs exactly it: the node modules hold no merge or outcome code of their own."""

import ast
import importlib
import inspect
import itertools
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gradientmail.protocol import keys
from gradientmail.protocol.learner import (
    Apply,
    Dropped,
    Learner,
    Publish,
    Recorded,
    Resolved,
    TakeSnapshot,
    Unavailable,
)
from gradientmail.protocol.learner_inputs import (
    BeganClosing,
    DownloadFailed,
    DroppedAll,
    Finalized,
    Flushed,
    PublishEnded,
    RecordSeen,
    Stepped,
    Synced,
    VersionReady,
)
from gradientmail.protocol.records import BlobRef, Participant, Rejection, RoundRecord, RunConfig

node_module = importlib.import_module("gradientmail._node.node")
driver_module = importlib.import_module("gradientmail._node.learner_driver")
receive_module = importlib.import_module("gradientmail._node.receive")
CONFIG = RunConfig(fragments=2, sync_every=4, grace=1.0, overlap=None)
"""Unpaced: the schedule rules that react to the timing are what most tests here check; the
paced learner (the default overlap) has its own tests below (``with_overlap``)."""
REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


def record(
    round: int,
    *,
    included: tuple[str, ...] = (),
    rejected: tuple[str, ...] = (),
    closing: tuple[str, ...] = (),
    grace: float = 0.0,
    arrived: dict[str, float] | None = None,
    paces: dict[str, float] | None = None,
) -> RoundRecord:
    times = arrived or {}
    made = RoundRecord(
        round=round,
        fragment=round % 2,
        version=round // 2 + 1,
        committed_by="s",
        participants=tuple(
            Participant(learner=name, weight=1.0, steps=1, tokens=1, base_version=0)
            if name not in times
            else Participant(
                learner=name, weight=1.0, steps=1, tokens=1, base_version=0, arrived=times[name]
            )
            for name in included
        )
        + tuple(
            Participant(learner=name, weight=1.0, steps=1, tokens=1, base_version=0, closing=True)
            for name in closing
        ),
        rejected=tuple(
            Rejection(learner=name, reason="outlier", steps=1, tokens=1) for name in rejected
        ),
        quorum_seconds=0.0,
        grace_seconds=grace,
        cosine=None,
        theta=REF,
        outer=REF,
        update=REF,
    )
    stated = paces or {}
    participants = tuple(
        msgspec.structs.replace(p, step_time=stated[p.learner]) if p.learner in stated else p
        for p in made.participants
    )
    return msgspec.structs.replace(made, participants=participants)


def fresh(name: str = "me") -> Learner:
    zero = (torch.zeros(2),)
    return Learner.start(CONFIG, name, (0, 0), (zero, zero), -1)


def take(learner: Learner, actions: list[object]) -> tuple[Learner, list[Publish]]:
    """Carry out the ``TakeSnapshot`` actions as the driver does: hand over a copy."""
    jobs = []
    for action in actions:
        if isinstance(action, TakeSnapshot):
            learner, job = learner.took(action.fragment, (torch.ones(2),))
            jobs.append(job)
    return learner, jobs


def test_a_snapshot_targets_the_round_after_its_base_and_blocks_until_aligned() -> None:
    learner = fresh()
    learner, actions = learner.handle(Stepped(10, now=0.0))
    assert actions == []
    learner, actions = learner.handle(Stepped(10, now=1.0))
    assert actions == [TakeSnapshot(0, 0)]
    learner, jobs = take(learner, actions)
    assert [(j.fragment, j.round, j.steps, j.tokens) for j in jobs] == [(0, 0, 2, 20)]
    assert learner.slots[0].blocked
    assert not learner.slots[1].blocked
    learner, _ = learner.handle(PublishEnded(0, 0, True))
    learner, actions = learner.handle(RecordSeen(record(0, included=("me",)), now=2.0))
    assert [type(a) for a in actions] == [Recorded, Resolved]
    assert learner.ledger[0].committed.steps == 2
    [download] = learner.downloads()
    assert (download.fragment, download.record.round) == (0, 0)
    assert download.base is not None  # the next version: base + update
    assert torch.equal(download.base[0], torch.zeros(2))


def test_a_record_waits_for_the_publish_to_its_round() -> None:
    learner = fresh()
    learner, _ = learner.handle(Stepped(1, now=0.0))
    learner, actions = learner.handle(Stepped(1, now=1.0))
    learner, _ = take(learner, actions)
    learner, actions = learner.handle(RecordSeen(record(0, included=("me",)), now=1.5))
    assert actions == []
    assert learner.seen_round == 0
    assert learner.newest_round == -1
    learner, actions = learner.handle(PublishEnded(0, 0, True))
    assert isinstance(actions[0], Recorded)
    assert learner.newest_round == 0


def finals_out(model: tuple[tuple[torch.Tensor, ...], ...]) -> tuple[Learner, list[Publish]]:
    """Five steps, then closing with ``model``: the flush of both fragments committed with
    this learner (rounds 0 and 1, θ = 1) and the final snapshots answered (rounds 2 and 3)."""
    learner, _ = fresh().handle(Stepped(5, now=0.0))
    learner, _ = learner.handle(BeganClosing(model))
    learner, actions = learner.handle(Flushed(now=1.0))
    learner, jobs = take(learner, actions)
    for fragment, job in enumerate(jobs):
        learner, _ = learner.handle(PublishEnded(fragment, job.round, True))
        learner, _ = learner.handle(RecordSeen(record(job.round, included=("me",)), now=2.0))
        learner, _ = learner.handle(VersionReady(fragment, job.round, (torch.full((2,), 1.0),)))
    learner, _ = learner.handle(Flushed(now=3.0))
    return learner.handle(Finalized())


def published_at_two() -> Learner:
    """One step a second; fragment 0 comes due after step 2 (t=2) and goes out; step 3 at
    t=3."""
    learner, _ = out_at(fresh(), 2.0).handle(Stepped(1, now=3.0))
    return learner


def test_a_rejected_snapshot_drops_its_steps_and_resets_to_theta() -> None:
    learner = published_at_two()
    learner, actions = learner.handle(RecordSeen(record(0, rejected=("me",)), now=3.0))
    assert [type(a) for a in actions] == [Recorded, Resolved, Dropped]
    assert learner.ledger[0].dropped.steps == 3  # the snapshot's two and the one since
    learner, _ = learner.handle(VersionReady(0, 0, (torch.full((2,), 7.0),)))
    learner, actions = learner.handle(Stepped(0, now=4.0))
    apply = next(a for a in actions if isinstance(a, Apply))
    assert apply.outcome == "rejected"
    assert [a.steps for a in actions if isinstance(a, Dropped)] == [1]  # reset to θ
    assert learner.ledger[0].balanced
    assert learner.slots[0].version == 1


def test_a_closing_learner_publishes_its_model_at_the_close_as_final_once_settled() -> None:
    idle, _ = fresh().handle(BeganClosing(((torch.ones(2),), (torch.ones(2),))))
    assert idle.handle(Finalized()) == (idle, [])  # never stepped: its model is θ
    assert idle.finished
    learner, _ = fresh().handle(Stepped(5, now=0.0))
    model = ((torch.full((2,), 3.0),), (torch.full((2,), 4.0),))
    learner, _ = learner.handle(BeganClosing(model))
    learner, actions = learner.handle(Flushed(now=1.0))
    learner, jobs = take(learner, actions)
    assert learner.handle(Finalized()) == (learner, [])  # not settled: the flush comes first
    for fragment, job in enumerate(jobs):
        learner, _ = learner.handle(PublishEnded(fragment, job.round, True))
        learner, _ = learner.handle(RecordSeen(record(job.round, included=("me",)), now=2.0))
        learner, _ = learner.handle(VersionReady(fragment, job.round, (torch.full((2,), 1.0),)))
    learner, _ = learner.handle(Flushed(now=3.0))
    assert learner.settled
    learner, finals = learner.handle(Finalized())
    assert [(j.fragment, j.round, j.base_version, j.steps, j.tokens) for j in finals] == [
        (0, 2, 1, 0, 0),
        (1, 3, 1, 0, 0),
    ]
    assert all(j.final and j.snapshot is m for j, m in zip(finals, model, strict=True))
    assert learner.handle(Finalized()) == (learner, [])  # once
    assert not learner.finished
    ledger = learner.ledger
    for job in finals:
        learner, _ = learner.handle(PublishEnded(job.fragment, job.round, True))
        learner, _ = learner.handle(RecordSeen(record(job.round, included=("me",)), now=4.0))
        learner, _ = learner.handle(VersionReady(job.fragment, job.round, (torch.full((2,), 2.0),)))
    learner, actions = learner.handle(Flushed(now=5.0))
    # The learner ends on the final round's θ, whatever its weights held beyond θ (under
    # ``topk``, what its deltas had not sent, which its final snapshots carried); the steps
    # were all accounted for before.
    assert [(a.outcome, a.version) for a in actions if isinstance(a, Apply)] == [
        ("final", 2),
        ("final", 2),
    ]
    assert learner.finished
    assert learner.ledger == ledger


def test_a_final_snapshot_a_round_left_out_goes_out_once_more_for_the_next_round() -> None:
    """Rounds 2 and 3 commit without this learner's finals (another learner's flush filled
    them): it publishes them again for rounds 4 and 5 once it holds 2's and 3's θ, and is
    not finished before. Left out again, it publishes no third time and ends on the
    others' θ: a left-out final's round merges as late (what the weights held beyond θ
    goes out again with the next final), the last as final."""
    model = ((torch.full((2,), 3.0),), (torch.full((2,), 4.0),))
    learner, finals = finals_out(model)
    assert [j.round for j in finals] == [2, 3]
    for cycle, expected, merge in ((1, [4, 5], "late"), (2, [], "final")):
        for job in finals:
            learner, _ = learner.handle(PublishEnded(job.fragment, job.round, True))
            learner, _ = learner.handle(RecordSeen(record(job.round, included=("other",)), now=4.0))
            assert not learner.finished  # the left-out round's θ is not applied yet
            theta = (torch.full((2,), float(cycle + 1)),)
            learner, _ = learner.handle(VersionReady(job.fragment, job.round, theta))
        learner, actions = learner.handle(Flushed(now=5.0))
        assert [a.outcome for a in actions if isinstance(a, Apply)] == [merge, merge]
        learner, finals = learner.handle(Finalized())
        assert [j.round for j in finals] == expected
        # The other trained on in the rounds that left them out: sent again, a final adds
        # back what those rounds moved θ by (1 → 2), so as not to take its steps back.
        assert all(
            j.final and torch.equal(j.snapshot[0], model[j.fragment][0] + cycle) for j in finals
        )
        assert all(j.base_version == cycle + 1 for j in finals)
        assert learner.finished == (cycle == 2)


def test_a_final_snapshot_left_out_by_flush_rounds_goes_out_until_it_meets_their_finals() -> None:
    """The other learner trained on in round 3 (left out once: out again, as above), then
    its flush filled round 5 and round 7 closed empty (it had published past it): only
    closing snapshots or none, so out again each time (its flush is finite), and its final
    met this one's in round 9: finished there. Round 2 had both finals at once."""
    model = ((torch.full((2,), 3.0),), (torch.full((2,), 4.0),))
    learner, finals = finals_out(model)
    assert [j.round for j in finals] == [2, 3]
    rounds = {
        2: record(2, closing=("me", "other")),
        3: record(3, included=("other",)),
        4: record(4),
        5: record(5, closing=("other",)),
        6: record(6),
        7: record(7),
        8: record(8),
        9: record(9, closing=("me", "other")),
    }
    published = [2, 3]
    for round, seen in rounds.items():
        learner, _ = learner.handle(RecordSeen(seen, now=4.0))
        learner, _ = learner.handle(
            VersionReady(round % 2, round, (torch.full((2,), float(round)),))
        )
        learner, _ = learner.handle(Flushed(now=5.0))
        learner, again = learner.handle(Finalized())
        for job in again:
            learner, _ = learner.handle(PublishEnded(job.fragment, job.round, True))
        published += [j.round for j in again]
        # Round 3, in which the other trained on, moved θ by 2 (1 → 3): added back each
        # time; its flush rounds' moves are not (the final takes their look-ahead back).
        assert all(j.final and torch.equal(j.snapshot[0], model[1][0] + 2) for j in again)
        assert learner.finished == (round == 9), round
    assert published == [2, 3, 5, 7, 9]


def test_a_final_snapshot_a_round_rejected_goes_out_once_more_only() -> None:
    """Rejected (a diverged model's final, say) rather than left out for others' flushes:
    out again once, as any left-out final, and not after a second rejection, even though
    no participant trained on in those rounds."""
    learner, finals = finals_out(((torch.ones(2),), (torch.ones(2),)))
    published = [j.round for j in finals]
    for round in range(2, 8):
        seen = record(
            round, rejected=("me",) if round % 2 else (), closing=("me",) * (1 - round % 2)
        )
        learner, _ = learner.handle(RecordSeen(seen, now=4.0))
        learner, _ = learner.handle(
            VersionReady(round % 2, round, (torch.full((2,), float(round)),))
        )
        learner, _ = learner.handle(Flushed(now=5.0))
        learner, again = learner.handle(Finalized())
        published += [j.round for j in again]
    assert published == [2, 3, 5]
    assert learner.finished


def test_a_closing_learner_whose_peers_went_on_a_whole_cycle_publishes_no_final() -> None:
    learner, _ = fresh().handle(Stepped(5, now=0.0))
    learner, _ = learner.handle(BeganClosing(((torch.ones(2),), (torch.ones(2),))))
    learner, actions = learner.handle(Flushed(now=1.0))
    learner, jobs = take(learner, actions)
    for fragment, job in enumerate(jobs):
        learner, _ = learner.handle(PublishEnded(fragment, job.round, True))
    # Its flush rounds (0, 1), then a whole cycle of the others' rounds (2, 3) and one more.
    for round in range(5):
        seen = record(round, included=("me",) if round < 2 else ("a",))
        learner, _ = learner.handle(RecordSeen(seen, 2.0))
        learner, _ = learner.handle(
            VersionReady(round % 2, round, (torch.full((2,), float(round)),))
        )
        learner, _ = learner.handle(Flushed(now=3.0))
        if round == 3:
            assert learner.settled
            assert learner.handle(Finalized())[1] != []  # within a cycle: still closing with them
    assert learner.settled
    assert learner.handle(Finalized()) == (learner, [])
    assert learner.finished


@pytest.mark.parametrize("others", [3, 4])
def test_a_learner_that_stood_still_while_the_others_went_on_a_whole_cycle_drops_its_steps(
    others: int,
) -> None:
    """It stepped, then stood still (a validation pass, a pause) through the others' rounds
    0 … ``others``; its model holds none of them when closing begins. Past a whole cycle of
    them (``behind``) its unsent steps are dropped, it publishes nothing and ends on their θ
    (every version it applies merges as ``final``); within one it flushes and closes with
    them."""
    learner, _ = fresh().handle(Stepped(5, now=0.0))
    for round in range(others + 1):
        learner, _ = learner.handle(RecordSeen(record(round, included=("a",)), 1.0))
    for round in (others - 1, others):
        learner, _ = learner.handle(VersionReady(round % 2, round, (torch.full((2,), 1.0),)))
    behind = others > 3
    assert learner.behind == behind
    learner, dropped = learner.handle(BeganClosing(((torch.ones(2),), (torch.ones(2),))))
    learner, actions = learner.handle(Flushed(now=2.0))
    learner, jobs = take(learner, actions)
    if behind:
        assert [(d.fragment, d.steps, d.reason) for d in dropped] == [
            (0, 1, "behind"),
            (1, 1, "behind"),
        ]
        assert jobs == []
        applied = sorted((a.outcome, a.round) for a in actions if isinstance(a, Apply))
        assert applied == [("final", others - 1), ("final", others)]
        assert all(ledger.dropped.steps == 1 for ledger in learner.ledger.fragments)
        assert learner.settled
        assert learner.handle(Finalized()) == (learner, [])
        assert learner.finished
        return
    assert dropped == []
    assert sorted(job.round for job in jobs) == [others + 1, others + 2]
    for job in jobs:
        learner, _ = learner.handle(PublishEnded(job.fragment, job.round, True))
    for round in (others + 1, others + 2):
        learner, _ = learner.handle(RecordSeen(record(round, included=("me",)), 3.0))
        learner, _ = learner.handle(VersionReady(round % 2, round, (torch.full((2,), 2.0),)))
        learner, _ = learner.handle(Flushed(now=3.0))
    assert learner.settled
    learner, finals = learner.handle(Finalized())
    assert [(job.final, job.closing) for job in finals] == [(True, True)] * 2
    assert not learner.finished


def test_learners_closing_together_publish_finals_however_long_their_flushes_take() -> None:
    learner, _ = fresh().handle(Stepped(5, now=0.0))
    learner, _ = learner.handle(BeganClosing(((torch.ones(2),), (torch.ones(2),))))
    learner, actions = learner.handle(Flushed(now=1.0))
    learner, jobs = take(learner, actions)
    assert all(job.closing and not job.final for job in jobs)
    for fragment, job in enumerate(jobs):
        learner, _ = learner.handle(PublishEnded(fragment, job.round, True))
    # Its flush rounds (0, 1), then three rounds of the others' flushes only: the others
    # closed too, each flush slow, and nobody trained on.
    for round in range(5):
        seen = record(round, included=("me",) * (round < 2), closing=("a", "b"))
        learner, _ = learner.handle(RecordSeen(seen, 2.0))
        learner, _ = learner.handle(
            VersionReady(round % 2, round, (torch.full((2,), float(round)),))
        )
        learner, _ = learner.handle(Flushed(now=3.0))
    assert learner.settled
    learner, finals = learner.handle(Finalized())
    assert [(j.fragment, j.final, j.closing) for j in finals] == [(0, True, True), (1, True, True)]


def test_a_corrupt_update_falls_back_to_theta_and_an_unusable_theta_is_reported_once() -> None:
    learner = fresh()
    learner, _ = learner.handle(RecordSeen(record(0), now=0.0))
    learner, _ = learner.handle(RecordSeen(record(1), now=0.0))
    assert [d.base is not None for d in learner.downloads()] == [True, True]
    learner, actions = learner.handle(DownloadFailed(0, 0, "update", "corrupt", "flipped byte"))
    assert actions == []
    assert [d.base is None for d in learner.downloads()] == [True, False]
    learner, actions = learner.handle(DownloadFailed(0, 0, "theta", "corrupt", "flipped byte"))
    assert [type(a) for a in actions] == [Unavailable]
    learner, actions = learner.handle(DownloadFailed(0, 0, "theta", "corrupt", "flipped byte"))
    assert actions == []
    # The other fragment is prepared all the same.
    learner, _ = learner.handle(VersionReady(1, 1, (torch.ones(2),)))
    learner, actions = learner.handle(Stepped(0, now=1.0))
    assert [a.fragment for a in actions if isinstance(a, Apply)] == [1]
    # A newer record of the stuck fragment replaces it.
    learner, _ = learner.handle(RecordSeen(record(2), now=2.0))
    assert [(d.fragment, d.record.round) for d in learner.downloads()] == [(0, 2)]


def test_a_learner_that_missed_a_round_moves_its_schedule_into_the_others_rounds() -> None:
    """One step a second; the others published fragment 0 at t=2 (the record, seen at t=3.5,
    waited 2.5 s of grace); this learner's snapshot went out at t=4, late. Its phase moves
    by ceil((2 + 0.5) / 1) = 3 steps (lag plus half the grace, in steps), so its fragments
    come due 3 steps earlier; an included snapshot moves nothing."""
    learner = fresh()
    learner, _ = learner.handle(Stepped(1, now=3.0))
    learner, actions = learner.handle(Stepped(1, now=4.0))
    learner, _ = take(learner, actions)
    learner, _ = learner.handle(PublishEnded(0, 0, True))
    learner, _ = learner.handle(RecordSeen(record(0, included=("other",), grace=2.5), now=4.5))
    assert learner.phase == 3
    learner, _ = learner.handle(VersionReady(0, 0, (torch.ones(2),)))
    due = []
    for t in range(5, 9):
        learner, actions = learner.handle(Stepped(1, now=float(t)))
        due += [(learner.step, a.fragment) for a in actions if isinstance(a, TakeSnapshot)]
    assert due == [(3, 0), (5, 1)]  # without the move: (4, 1), (6, 0)
    learner, actions = learner.handle(Stepped(1, now=9.0))
    learner, _ = take(learner, actions)


@pytest.mark.parametrize(("waited", "phase"), [(0.2, 0), (0.4, 0), (0.7, 2)])
def test_an_included_snapshot_moves_the_schedule_only_from_the_late_half_of_the_grace(
    waited: float, phase: int
) -> None:
    """Included at t=4 in a round that waited ``waited`` seconds of its 1 s grace for it
    (seen at 4.1): a lag behind the quorum over half the grace moves the phase by
    ceil((lag + 0.5) / 1); less leaves it alone."""
    learner = fresh()
    learner, _ = learner.handle(Stepped(1, now=3.0))
    learner, actions = learner.handle(Stepped(1, now=4.0))
    learner, _ = take(learner, actions)
    learner, _ = learner.handle(PublishEnded(0, 0, True))
    learner, _ = learner.handle(RecordSeen(record(0, included=("me", "x"), grace=waited), now=4.1))
    assert learner.phase == phase


def due_steps(learner: Learner, start: int, end: int) -> list[tuple[int, int]]:
    due = []
    for t in range(start, end):
        learner, actions = learner.handle(Stepped(1, now=float(t)))
        due += [(learner.step, a.fragment) for a in actions if isinstance(a, TakeSnapshot)]
        learner, _ = take(learner, actions)
    return due


@pytest.mark.parametrize(
    ("last", "held"),
    [(0.5, 0), (1.2, 1), (2.4, 2), (4.5, 0)],
    ids=["under-a-step", "one-step", "two-steps", "a-pause"],
)
def test_a_learner_a_round_waited_for_holds_its_schedule_back(last: float, held: int) -> None:
    """The round noted this learner's snapshot first and the other's ``last`` seconds later:
    a wait of a step or more (steps of 1 s) holds the schedule still for the whole steps
    waited, so every fragment comes due that much later and none twice; a wait of a period
    (4 steps) or more is the other's pause, not a phase, and holds nothing."""
    learner = published_at_two()
    seen = record(0, included=("me", "other"), arrived={"me": 0.0, "other": last})
    learner, _ = learner.handle(RecordSeen(seen, now=3.5))
    assert learner.hold_until == (3 + held if held else 0)
    learner, _ = learner.handle(VersionReady(0, 0, (torch.ones(2),)))
    # Without a hold fragment 1 comes due after step 4, then fragment 0 after step 6.
    assert due_steps(learner, 4, 10) == [(4 + held, 1), (6 + held, 0)]


def test_a_record_without_arrivals_or_without_this_learner_moves_nothing() -> None:
    for seen in (
        record(0, included=("me", "other")),
        record(0, included=("me", "other"), arrived={"other": 2.0}),
    ):
        learner, _ = published_at_two().handle(RecordSeen(seen, now=3.5))
        assert learner.hold_until == 0


def with_overlap(overlap: int | None) -> Learner:
    zero = (torch.zeros(2),)
    config = RunConfig(fragments=2, sync_every=4, grace=1.0, overlap=overlap)
    return Learner.start(config, "me", (0, 0), (zero, zero), -1)


def out_at(learner: Learner, at: float) -> Learner:
    """Two steps, a second apart, the second at ``at``: fragment 0's snapshot after it
    goes out."""
    learner, _ = learner.handle(Stepped(1, now=at - 1))
    learner, actions = learner.handle(Stepped(1, now=at))
    learner, _ = take(learner, actions)
    learner, _ = learner.handle(PublishEnded(0, 0, True))
    return learner


def paced(overlap: int | None) -> Learner:
    """A snapshot out at t=2 under ``RunConfig.overlap``; round 0 committed with this
    learner, seen at t=2.5 and its version prepared at once."""
    learner = out_at(with_overlap(overlap), 2.0)
    learner, _ = learner.handle(RecordSeen(record(0, included=("me",)), now=2.5))
    return learner.handle(VersionReady(0, 0, (torch.ones(2),)))[0]


def applied_at(learner: Learner) -> int:
    """The step at which fragment 0's prepared version is applied, one step a second."""
    for t in range(3, 8):
        learner, actions = learner.handle(Stepped(1, now=float(t)))
        if any(isinstance(a, Apply) and a.fragment == 0 for a in actions):
            return learner.step
        learner, _ = take(learner, actions)
    raise AssertionError("never applied")


@pytest.mark.parametrize(("overlap", "step"), [(None, 3), (1, 3), (2, 4), (3, 5), (4, 6)])
def test_with_overlap_a_version_is_applied_exactly_overlap_steps_after_its_snapshot(
    overlap: int | None, step: int
) -> None:
    """The snapshot went out after step 2 and its round's version was ready at t=2.5:
    without overlap it is applied at the next step, with it at step 2 + overlap however
    early it was ready; overlap = sync_every applies it in the step whose end takes the
    fragment's next snapshot (first the version, then the snapshot)."""
    learner = paced(overlap)
    assert applied_at(learner) == step
    if overlap == 4:
        for t in range(3, 7):
            learner, actions = learner.handle(Stepped(1, now=float(t)))
        kinds = [type(a) for a in actions if getattr(a, "fragment", None) == 0]
        assert kinds == [Apply, TakeSnapshot]


def test_with_overlap_the_step_that_applies_a_version_waits_for_it_for_twice_the_grace() -> None:
    """Snapshot at t=2 (grace 1 s): the step after step 3 is the one that applies round 0's
    version (overlap 2), so it must wait until the version is ready or t=4; a version
    ready, closing, or no overlap at all: no wait."""
    learner = out_at(with_overlap(2), 2.0)
    assert learner.wait_until(2.1) is None  # the next step, 3, applies nothing
    learner, _ = learner.handle(Stepped(1, now=3.0))
    assert learner.wait_until(3.9) == 4.0
    assert learner.wait_until(4.0) is None  # the round is late: go on, apply it when it comes
    assert learner.handle(BeganClosing([(torch.zeros(2),)] * 2))[0].wait_until(3.9) is None
    learner, _ = learner.handle(RecordSeen(record(0, included=("me",)), now=3.2))
    assert learner.wait_until(3.5) == 4.0  # the record is in, its version is not prepared
    learner, _ = learner.handle(VersionReady(0, 0, (torch.ones(2),)))
    assert learner.wait_until(3.5) is None
    assert published_at_two().wait_until(3.5) is None


def test_synchronous_a_version_is_applied_before_the_step_after_its_snapshot() -> None:
    """Overlap 0: right after the step that snapshotted (step 2, t=2) the learner must wait
    for its round's version, until it is ready or twice the grace; ``Synced`` then applies
    it, counting no step, so step 3 trains on it (lag 0). Nothing to apply, nothing done."""
    learner = out_at(with_overlap(0), 2.0)
    assert learner.wait_until(2.1) == 4.0
    learner, actions = learner.handle(Synced(now=2.2))
    assert actions == []
    learner, _ = learner.handle(RecordSeen(record(0, included=("me",)), now=2.5))
    learner, _ = learner.handle(VersionReady(0, 0, (torch.ones(2),)))
    assert learner.wait_until(2.6) is None
    learner, actions = learner.handle(Synced(now=2.6))
    applied = [a for a in actions if isinstance(a, Apply)]
    assert [(a.fragment, a.outcome) for a in applied] == [(0, "included")]
    assert learner.step == 2
    learner, actions = learner.handle(Stepped(1, now=3.0))
    assert not any(isinstance(a, Apply) for a in actions)


def test_with_overlap_the_rounds_pace_the_learner_and_its_schedule_stays_put() -> None:
    """The rules that move a learner's schedule for a snapshot that was waited on (late in
    the grace, or a step or more before the last participant's) or that missed its round
    leave a paced learner alone: its overlap step already waits for the rounds, and the
    others' rounds wait for it."""
    learner = out_at(with_overlap(2), 4.0)
    late = record(0, included=("me", "x"), grace=0.7, arrived={"me": 0.0, "x": 2.4})
    learner, _ = learner.handle(RecordSeen(late, now=4.1))
    assert (learner.phase, learner.hold_until) == (0, 0)
    unpaced, _ = out_at(with_overlap(None), 4.0).handle(RecordSeen(late, now=4.1))
    assert unpaced.phase == 2
    missed = record(0, included=("other",), grace=2.5)
    learner, _ = out_at(with_overlap(2), 4.0).handle(RecordSeen(missed, now=4.5))
    assert (learner.phase, learner.hold_until) == (0, 0)
    unpaced, _ = out_at(with_overlap(None), 4.0).handle(RecordSeen(missed, now=4.5))
    assert unpaced.phase == 3


@pytest.mark.parametrize("overlap", [2, None])
@pytest.mark.parametrize(("fragments", "sync_every"), [(2, 4), (5, 100), (3, 10), (4, 4)])
@pytest.mark.parametrize("newest", [-1, 0, 6, 13])
def test_a_learner_that_joins_mid_run_takes_the_rounds_in_order_from_the_next(
    fragments: int, sync_every: int, newest: int, overlap: int | None
) -> None:
    """Joined once round ``newest`` committed (versions as a joiner loads them), its
    snapshots go to rounds ``newest + 1``, ``newest + 2``, ... with the fragment's interval
    of steps between them, the first at its first step (at the run's start, before round 0:
    one interval in, as the learners that start the run). Before the phase, a learner that
    restarted at step 0 in a run at step 445 (H 100, F 5) published each fragment 45 steps
    out of step with the others and, paced, waited at every round for the rest of the run
    (the full-size kill benchmark); due an interval after joining, the others' rounds
    waited for it instead (up to an interval: 3.7 s there)."""
    config = RunConfig(fragments=fragments, sync_every=sync_every, overlap=overlap)
    versions = tuple((newest - f) // fragments + 1 if newest >= f else 0 for f in range(fragments))
    zero = (torch.zeros(2),)
    learner = Learner.start(config, "me", versions, (zero,) * fragments, newest)
    rounds = []
    for step in range(1, 2 * sync_every + 1):
        learner, actions = learner.handle(Stepped(1, now=float(step)))
        for action in actions:
            if isinstance(action, TakeSnapshot):
                rounds.append((action.round, step))
                learner, _ = learner.took(action.fragment, zero)
                learner, _ = learner.handle(PublishEnded(action.fragment, action.round, True))
    expected = [newest + 1 + k for k in range(len(rounds))]
    assert [r for r, _ in rounds] == expected
    interval = sync_every // fragments
    steps = [s for _, s in rounds]
    assert steps[0] in ((interval, interval + 1) if newest < 0 else (1,))
    assert all(b - a in (interval, interval + 1) for a, b in itertools.pairwise(steps))


@pytest.mark.parametrize("prepared", [True, False], ids=["applied", "pending"])
def test_a_joiner_takes_the_round_after_the_newest_record_seen_by_its_first_step(
    prepared: bool,
) -> None:
    """A record that commits between joining (after round 6) and the first step moves the
    joiner's first round on with it: round 8, at the first step, whether round 7's version
    is applied by then or still downloading (a phase fixed at joining would make round 7's
    fragment due: a snapshot for round 9, a whole period early, or none)."""
    config = RunConfig(fragments=2, sync_every=8, overlap=2)
    zero = (torch.zeros(2),)
    learner = Learner.start(config, "me", (4, 3), (zero, zero), 6)
    learner, _ = learner.handle(RecordSeen(record(7, included=("other",)), now=0.5))
    if prepared:
        learner, _ = learner.handle(VersionReady(1, 7, zero))
    learner, actions = learner.handle(Stepped(1, now=1.0))
    snapshots = [a for a in actions if isinstance(a, TakeSnapshot)]
    assert [(a.fragment, a.round) for a in snapshots] == [(0, 8)]


def test_a_round_is_due_from_a_snapshot_until_its_record_or_twice_the_grace() -> None:
    """The receive loop polls at the due pace while this is true (grace 1 s here)."""
    learner = fresh()
    assert not learner.awaiting(0.0)
    learner, _ = learner.handle(Stepped(1, now=1.0))
    learner, actions = learner.handle(Stepped(1, now=2.0))
    assert learner.awaiting(2.0)  # the snapshot is going out
    learner, _ = take(learner, actions)
    learner, _ = learner.handle(PublishEnded(0, 0, True))
    assert learner.awaiting(3.9)
    assert not learner.awaiting(4.0)  # stuck somewhere slower: the idle pace
    learner, _ = learner.handle(RecordSeen(record(0, included=("me",)), now=3.0))
    assert not learner.awaiting(3.0)


class LearnerMachine(RuleBasedStateMachine):
    """Random steps, publishes and their failures, records (included, rejected, late,
    foreign), downloads that work, fail or find blobs corrupt, and restarts (a new life of
    the learner at the versions it held): the ledger stays balanced, every local step is in
    it, a fragment holds at most one unresolved snapshot, and every snapshot targets the
    round after its base."""

    config = CONFIG

    def __init__(self) -> None:
        super().__init__()
        zero = (torch.zeros(2),)
        self.learner = Learner.start(self.config, "me", (0, 0), (zero, zero), -1)
        self.rounds: list[RoundRecord] = []
        self.now = 0.0
        self.steps = 0
        self.jobs: list[Publish] = []

    def _carry(self, actions: list[object]) -> None:
        for action in actions:
            if isinstance(action, TakeSnapshot):
                slot = self.learner.slots[action.fragment]
                assert action.round == keys.round_of(action.fragment, slot.version + 1, 2)
                self.learner, job = self.learner.took(action.fragment, (torch.ones(2),))
                self.jobs.append(job)

    @rule(tokens=st.integers(min_value=0, max_value=9), dt=st.floats(0.0, 3.0))
    def step(self, tokens: int, dt: float) -> None:
        self.now += dt
        self.steps += 1
        sent = {f: s.published.round for f, s in enumerate(self.learner.slots) if s.published}
        self.learner, actions = self.learner.handle(Stepped(tokens, self.now))
        self._carry(actions)
        # A step applies the version of the round its snapshot went to overlap steps after
        # that snapshot at the earliest (the flush applies at once; a later round's version,
        # the snapshot's round already passed, is applied when ready).
        least = self.config.overlap or 0
        held = [a for a in actions if isinstance(a, Apply) and sent.get(a.fragment) == a.round]
        assert all(a.lag >= least for a in held if a.lag is not None)

    @rule()
    def flush(self) -> None:
        self.learner, actions = self.learner.handle(Flushed(self.now))
        self._carry(actions)

    @precondition(lambda self: self.jobs)
    @rule(ok=st.booleans())
    def publish_returns(self, ok: bool) -> None:
        job = self.jobs.pop(0)
        self.learner, actions = self.learner.handle(PublishEnded(job.fragment, job.round, ok))
        self._carry(actions)

    @rule(
        fate=st.sampled_from(["included", "rejected", "absent"]),
        grace=st.floats(0, 2),
        pace=st.floats(0.001, 5.0),
    )
    def commit(self, fate: str, grace: float, pace: float) -> None:
        """A record; the other learner ``x`` states the step time ``pace`` (an adaptive
        learner's rate follows it)."""
        round = self.learner.seen_round + 1
        names: dict[str, tuple[str, ...]] = {"included": ("me", "x"), "rejected": ("x",)}
        rejected = ("me",) if fate == "rejected" else ()
        made = record(
            round,
            included=names.get(fate, ("x",)),
            rejected=rejected,
            grace=grace,
            paces={"x": pace},
        )
        self.rounds.append(made)
        self.learner, actions = self.learner.handle(RecordSeen(made, self.now))
        self._carry(actions)

    @rule(outcome=st.sampled_from(["ok", "gone", "corrupt"]))
    def download(self, outcome: str) -> None:
        for d in self.learner.downloads():
            stage = "theta" if d.base is None else "update"
            if outcome == "ok":
                self.learner = self.learner.handle(
                    VersionReady(d.fragment, d.record.round, (torch.ones(2),))
                )[0]
            else:
                self.learner, _ = self.learner.handle(
                    DownloadFailed(
                        d.fragment,
                        d.record.round,
                        stage,
                        outcome,
                        "test",  # type: ignore[arg-type]
                    )
                )

    @rule()
    def close_without_flush(self) -> None:
        """Leaving by an exception: every local step is dropped, a publish may still return."""
        self.learner, actions = self.learner.handle(DroppedAll("closed-without-flush", "closed"))
        self._carry(actions)

    @precondition(lambda self: not self.jobs)
    @rule()
    def restart(self) -> None:
        """A new life: joins at the versions it holds, after the newest round seen."""
        old = self.learner
        self.learner = Learner.start(
            self.config, "me", old.versions, [s.base for s in old.slots], old.seen_round
        )
        self.steps = 0

    @invariant()
    def balanced(self) -> None:
        learner = self.learner
        assert learner.step == self.steps
        for fragment in range(2):
            ledger = learner.ledger[fragment]
            assert ledger.balanced
            assert ledger.total.steps == learner.step
            slot = learner.slots[fragment]
            unresolved = slot.published is not None and slot.published.outcome is None
            assert (ledger.in_flight is not None) == unresolved
            if ledger.in_flight is not None and slot.published is not None:
                assert ledger.in_flight.round == slot.published.round
        assert 0 <= learner.phase < self.config.sync_every
        most = self.config.sync_every / self.config.fragments
        assert 1.0 <= learner.pace.rate <= max(1.0, most)


TestLearnerMachine = LearnerMachine.TestCase
TestLearnerMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


class PacedLearnerMachine(LearnerMachine):
    """The same under ``RunConfig.overlap``."""

    config = RunConfig(fragments=2, sync_every=4, grace=1.0, overlap=2)


TestPacedLearnerMachine = PacedLearnerMachine.TestCase
TestPacedLearnerMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


class AdaptiveLearnerMachine(LearnerMachine):
    """The same with a period long enough for a rate of up to 6: steps of 0 to 3 s against
    another learner's stated 0.001 to 5 s, so the rate goes up and down, and some steps make
    two fragments due."""

    config = RunConfig(fragments=2, sync_every=12, grace=1.0, overlap=None)


TestAdaptiveLearnerMachine = AdaptiveLearnerMachine.TestCase
TestAdaptiveLearnerMachine.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None
)


@pytest.mark.parametrize(
    ("module", "protocol_names"),
    [
        (node_module, {"Learner"}),
        (driver_module, {"Learner", "merge_into"}),
        (receive_module, {"apply_update", "check_record", "Download"}),
    ],
    ids=["node", "driver", "receive"],
)
def test_the_node_runs_the_pure_learner_and_has_no_merge_of_its_own(
    module: object, protocol_names: set[str]
) -> None:
    """The node's modules import the pure learner and the one merge (the driver), and the
    one ``apply_update`` and record check (the receive task, which rebuilds θ through
    ``RunReader``); they hold no tensor arithmetic of a merge, decide no outcome and keep no
    ledger of their own."""
    source = inspect.getsource(module)  # type: ignore[arg-type]
    tree = ast.parse(source)
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
        if node.module.startswith("gradientmail.protocol")
    }
    assert protocol_names <= imported
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not calls & {"sub_", "add_", "mul", "mul_", "recorded"}
    for name in ("merge_in_place", "LearnerState", "Ledger", '"included"', "'late'"):
        assert name not in source, f"{Path(inspect.getfile(module)).name} holds {name}"  # type: ignore[arg-type]
    if module is not driver_module:
        assigned = {
            target.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute)
        }
        assert "_state" not in assigned, "only the driver replaces the Learner value"


def test_nothing_moves_when_a_period_is_shorter_than_the_grace() -> None:
    """Steps of 0.2 s, a period of 4 steps (0.8 s) and a grace of 1 s: every phase lands in
    time, so a late snapshot is not a matter of phase."""
    learner = fresh()
    learner, _ = learner.handle(Stepped(1, now=3.8))
    learner, actions = learner.handle(Stepped(1, now=4.0))
    learner, _ = take(learner, actions)
    learner, _ = learner.handle(PublishEnded(0, 0, True))
    learner, _ = learner.handle(RecordSeen(record(0, included=("other",), grace=0.9), now=4.5))
    assert learner.phase == 0
