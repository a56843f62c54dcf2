"""``gradientmail.cli.learners.paces``: each learner's pace from the records, as status
shows it."""

import msgspec

from gradientmail.cli.learners import paces
from gradientmail.protocol.records import BlobRef, Participant, RoundRecord

REF = BlobRef(sha256="0" * 64, size=1, encoding="fp32")


def record(round: int, *participants: Participant) -> RoundRecord:
    return RoundRecord(
        round=round,
        fragment=round % 2,
        version=round // 2 + 1,
        committed_by="s",
        participants=participants,
        quorum_seconds=0.0,
        grace_seconds=0.0,
        cosine=None,
        update=REF,
    )


def took(learner: str, steps: int, step_time: float | None, waited: float | None) -> Participant:
    p = Participant(learner=learner, weight=0.5, steps=steps, tokens=steps, base_version=0)
    if step_time is not None:
        p = msgspec.structs.replace(p, step_time=step_time)
    if waited is not None:
        p = msgspec.structs.replace(p, waited=waited)
    return p


def test_each_learners_rate_steps_per_round_and_waiting_come_from_its_newest_rounds() -> None:
    records = [
        record(0, took("fast", 25, 0.1, 0.0), took("slow", 6, 0.4, 0.0)),
        record(1, took("fast", 25, 0.1, 0.0), took("slow", 7, 0.4, 0.0)),
        record(
            2, took("fast", 24, 0.1, 0.0), took("slow", 6, 0.5, 0.0), took("old", 0, None, None)
        ),
        record(3, took("fast", 0, None, None)),  # a final snapshot: no steps
    ]
    assert paces(records) == [
        {
            "learner": "fast",
            "rounds": 3,
            "steps_per_second": 10.0,
            "steps_per_round": 25,
            "waited": 0.0,
        },
        {
            "learner": "slow",
            "rounds": 3,
            "steps_per_second": 2.0,
            "steps_per_round": 6,
            "waited": 0.0,
        },
    ]
    assert paces(records, last=1) == []
    unstated = [record(0, took("x", 5, None, None))]
    assert paces(unstated) == [
        {
            "learner": "x",
            "rounds": 1,
            "steps_per_second": None,
            "steps_per_round": 5,
            "waited": None,
        }
    ]
