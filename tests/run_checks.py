"""What every multi-node test checks of a run, whatever happened to it: an event recorder,
one commit per round, and every step of a learner accounted for exactly once.

Imported by ``tests/node/node_helpers.py`` and ``tests/reliability/reliability_helpers.py``
(and, through them, by their worker processes, whose PYTHONPATH includes ``tests/``)."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from gradientmail.events import Event, RoundCommitted, SnapshotPublished, StepsDropped
from gradientmail.protocol.records import RoundRecord


@dataclass
class Recorder:
    """A sink keeping every event it is given."""

    events: list[Event] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


def commits_by_round(events: Sequence[Event]) -> dict[int, int]:
    """How many ``RoundCommitted`` events each round got, over all nodes."""
    counts: dict[int, int] = {}
    for event in events:
        if isinstance(event, RoundCommitted):
            counts[event.record.round] = counts.get(event.record.round, 0) + 1
    return counts


def assert_steps_accounted(
    learner: str, steps: int, tokens: int, events: Sequence[Event], records: Sequence[RoundRecord]
) -> None:
    """For each fragment, every step (and token) of ``learner`` is in exactly one committed
    round's participants or in one drop report: the ledger's invariant, seen from outside."""
    fragments = {record.fragment for record in records} | {
        e.fragment for e in events if isinstance(e, SnapshotPublished | StepsDropped)
    }
    for fragment in sorted(fragments):
        included = [
            p
            for record in records
            if record.fragment == fragment
            for p in record.participants
            if p.learner == learner
        ]
        dropped = [
            e
            for e in events
            if isinstance(e, StepsDropped) and e.learner == learner and e.fragment == fragment
        ]
        counted = sum(p.steps for p in included) + sum(e.steps for e in dropped)
        assert counted == steps, f"{learner} fragment {fragment}: {counted} of {steps} steps"
        counted_tokens = sum(p.tokens for p in included) + sum(e.tokens for e in dropped)
        assert counted_tokens == tokens, f"{learner} fragment {fragment}: tokens"
