"""A model of the protocol: N nodes' steps in adversarial interleavings, invariants after each.

The machine drives the node's own pure state machines (the syncer's ``RoundState`` and
``observed`` of ``protocol.rounds``; ``LeaseWatch``; the learner's ``Ledger``) and the real
record types and keys against an in-memory bucket whose listings may lag behind its writes.
Hypothesis chooses who acts when: claims race on stale listings, closers stall between their
blobs and their record, replies of successful writes are lost, nodes die and restart with
the same id, the clock jumps past every timeout, and an outsider puts broken claims and
snapshots into the rounds ahead. After every step:

- the records are contiguous from round 0, each names its round, fragment and version;
- every node that believes it committed a round holds the round's one record;
- the blobs that rebuild the newest ``keep_versions`` versions of each fragment
  (``checkpoint.retained``: the checkpoint below them and the updates after it) and Θ⁰
  exist and hash to their references;
- no step is counted twice: each learner's ledger balances, and the steps of its snapshots
  included by records never exceed the steps it took.
"""

import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from gradientmail.errors import RecordError
from gradientmail.protocol import keys, records
from gradientmail.protocol.checkpoint import is_checkpoint, retained
from gradientmail.protocol.codec import digest
from gradientmail.protocol.liveness import LeaseWatch, Liveness
from gradientmail.protocol.merge import Ledger
from gradientmail.protocol.records import (
    BlobRef,
    Participant,
    RoundClaim,
    RoundRecord,
    RoundRecordDraft,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.rounds import (
    Adopt,
    Again,
    Claim,
    Commit,
    Follow,
    RoundObservation,
    RoundState,
    TakeOver,
    Wait,
    observed,
    quorum_learners,
)

NODES = ("n0", "n1", "n2")
CONFIG = RunConfig(
    fragments=2, sync_every=2, quorum_min=1, quorum_fraction=0.5, grace=1.0,
    keep_rounds=3, keep_versions=2, checkpoint_every=3,
)  # fmt: skip
CLAIM_TIMEOUT = 6.0
LEASE_TIMEOUT = 3.0
POLL_INTERVAL = 1.0
"""``NodeOptions.poll_interval``: a syncer closing a round looks for its record this often."""
THETA0 = tuple(f"theta0:{f}".encode() for f in range(CONFIG.fragments))


class Bucket:
    """Create-once objects; a listing may show the keys as they were a few writes ago."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.history: list[frozenset[str]] = [frozenset()]

    def _changed(self) -> None:
        self.history = [*self.history[-3:], frozenset(self.objects)]

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key in self.objects:
            return False
        self.objects[key] = data
        self._changed()
        return True

    def get(self, key: str) -> bytes | None:
        return self.objects.get(key)

    def list(self, prefix: str, lag: int) -> list[str]:
        view = self.history[max(0, len(self.history) - 1 - lag)]
        return sorted(k for k in view if k.startswith(prefix) and k in self.objects)

    def delete(self, doomed: Sequence[str]) -> None:
        for key in doomed:
            self.objects.pop(key, None)
        self._changed()

    def put_blob(self, data: bytes) -> BlobRef:
        sha = digest(data)
        self.put_if_absent(keys.blob(sha), data)
        return BlobRef(sha256=sha, size=len(data), encoding="fp32")


@dataclass
class Closing:
    """A round this node decided to commit: its draft, then its blobs, then the record."""

    round: int
    draft: RoundRecordDraft
    blobs: tuple[BlobRef, ...] = ()


@dataclass
class SyncerModel:
    next_round: int
    watch: LeaseWatch = field(default_factory=lambda: LeaseWatch(Liveness(LEASE_TIMEOUT), 0.0))
    held: RoundState | None = None
    closing: Closing | None = None


@dataclass
class LearnerModel:
    ledger: Ledger
    versions: list[int]
    newest_round: int
    total_steps: int = 0
    included_steps: int = 0


@dataclass
class NodeModel:
    alive: bool
    beat: int
    syncer: SyncerModel
    learner: LearnerModel
    committed: set[int] = field(default_factory=set)


lags = st.integers(0, 2)
nodes = st.sampled_from(NODES)


class ProtocolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bucket = Bucket()
        self.now = 0.0
        self.theta0 = tuple(self.bucket.put_blob(data) for data in THETA0)
        self.nodes: dict[str, NodeModel] = {}
        self.retired_steps: dict[str, int] = dict.fromkeys(NODES, 0)
        self.included: dict[str, int] = dict.fromkeys(NODES, 0)

    @initialize()
    def start(self) -> None:
        for name in NODES:
            self.nodes[name] = self._fresh(name, lag=0)

    # -- helpers ------------------------------------------------------------------------------

    def _fresh(self, name: str, lag: int) -> NodeModel:
        """A node (re)started: what ``recover`` and ``load_newest`` rebuild from the store."""
        rounds = [
            r
            for k in self.bucket.list(keys.RECORDS, lag)
            if (r := keys.parse_record(k)) is not None
        ]
        next_round = rounds[-1] + 1 if rounds else 0
        versions = [0] * CONFIG.fragments
        for round in rounds[-CONFIG.fragments :]:
            versions[keys.fragment_of(round, CONFIG.fragments)] = keys.version_of(
                round, CONFIG.fragments
            )
        node = NodeModel(
            alive=True,
            beat=0,
            syncer=SyncerModel(next_round=next_round),
            learner=LearnerModel(Ledger.new(CONFIG.fragments), versions, next_round - 1),
        )
        self._beat(name, node)
        return node

    def _beat(self, name: str, node: NodeModel) -> None:
        node.beat += 1
        self.bucket.put_if_absent(keys.lease(name, node.beat, "learner"), b"{}")

    def _record(self, round: int) -> RoundRecord | None:
        data = self.bucket.get(keys.record(round))
        return None if data is None else records.decode(data, RoundRecord)

    def _claims(self, round: int, lag: int) -> tuple[tuple[int, str], ...]:
        found = []
        for key in self.bucket.list(keys.claims_prefix(round), lag):
            parsed = keys.parse_claim(key)
            data = self.bucket.get(key)
            if parsed is not None and data is not None:
                found.append((parsed[1], self._claimant(data)))
        return tuple(found)

    @staticmethod
    def _claimant(data: bytes) -> str:
        """``Store``'s reading of a claim: a malformed (or, signed, unverified) one names
        nobody."""
        try:
            return records.decode(data, RoundClaim).learner
        except RecordError:
            return ""

    def _published(self, round: int, lag: int) -> list[str]:
        return [
            parsed[1]
            for key in self.bucket.list(keys.snapshots_prefix(round), lag)
            if (parsed := keys.parse_snapshot(key)) is not None
        ]

    def _beats(self, lag: int) -> dict[str, dict[int, keys.Role]]:
        beats: dict[str, dict[int, keys.Role]] = {}
        for key in self.bucket.list(keys.LEASES, lag):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                beats.setdefault(parsed[0], {})[parsed[1]] = parsed[2]
        return beats

    def _observe(self, syncer: SyncerModel, held: RoundState, lag: int) -> RoundObservation:
        """``_node.syncer_task._observe``: one look at the round, through a lagging listing."""
        round = held.round
        looks = held.wants_record(self.now, POLL_INTERVAL)
        record = self._record(round) if looks else None
        claims = () if held.closing else self._claims(round, lag)
        published = frozenset(self._published(round, lag)) if held.closing or claims else None
        syncer.watch = syncer.watch.observed(self._beats(lag), self.now)
        live = syncer.watch.live(self.now)
        later = None
        if held.wants_later(published or frozenset(), quorum_learners(live, syncer.watch.learners)):
            later = frozenset(
                learner
                for ahead in range(round + 1, round + CONFIG.fragments)
                for learner in self._published(ahead, lag)
            )
        return RoundObservation(
            record=record,
            claims=claims,
            snapshots=published or frozenset(),
            live=live,
            learners=syncer.watch.learners,
            snapshots_at=self.now,
            leases_at=self.now,
            later=later,
            record_at=self.now if looks else None,
        )

    def _adopt(self, node: NodeModel, record: RoundRecord) -> None:
        node.syncer = SyncerModel(next_round=record.round + 1, watch=node.syncer.watch)

    def _write_once(self, key: str, data: bytes, lost_reply: bool) -> bool:
        """``Store.create``: a try whose reply was lost is retried, and the write is ours
        when the object found there has our bytes."""
        created = self.bucket.put_if_absent(key, data)
        if not lost_reply:
            return created
        return self.bucket.get(key) == data

    # -- time and leases ----------------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.3, 1.0, 2.5, 7.0]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @rule(name=nodes)
    def beat(self, name: str) -> None:
        node = self.nodes[name]
        if node.alive:
            self._beat(name, node)

    @rule(ahead=st.integers(0, 2), snapshot=st.booleans())
    def forge(self, ahead: int, snapshot: bool) -> None:
        """A writer outside the run puts a broken claim on a round at or ahead of the
        newest, at its next claim number, or a broken snapshot into it."""
        rounds = self._rounds()
        round = (rounds[-1] + 1 if rounds else 0) + ahead
        if snapshot:
            self.bucket.put_if_absent(keys.snapshot(round, "mallory"), b"{forged")
            return
        taken = self.bucket.list(keys.claims_prefix(round), 0)
        self.bucket.put_if_absent(keys.round_claim(round, len(taken)), b"{forged")

    # -- nodes dying and coming back --------------------------------------------------------

    @rule(name=nodes)
    def crash(self, name: str) -> None:
        """``name`` dies (one node at a time): what it held in memory is gone."""
        node = self.nodes[name]
        if all(other.alive for other in self.nodes.values()):
            node.alive = False
            self.retired_steps[name] += node.learner.total_steps

    @rule(name=nodes, lag=lags)
    def restart(self, name: str, lag: int) -> None:
        if not self.nodes[name].alive:
            committed = self.nodes[name].committed
            self.nodes[name] = self._fresh(name, lag)
            self.nodes[name].committed = committed

    # -- the learner ------------------------------------------------------------------------

    @rule(
        name=nodes,
        lag=lags,
        steps=st.integers(0, 3),
        tokens=st.integers(0, 100),
        publish=st.sets(st.integers(0, CONFIG.fragments - 1)),
        lost_reply=st.booleans(),
    )
    def learn(
        self, name: str, lag: int, steps: int, tokens: int, publish: set[int], lost_reply: bool
    ) -> None:
        """The learner folds the records it lists, takes ``steps`` local steps and publishes
        the fragments in ``publish`` that have steps and no snapshot in flight."""
        if not self.nodes[name].alive:
            return
        self._beat(name, self.nodes[name])
        self.receive(name, lag)
        learner = self.nodes[name].learner
        for _ in range(steps):
            learner.ledger = learner.ledger.stepped(tokens)
            learner.total_steps += 1
        for fragment in sorted(publish):
            self.publish(name, fragment, lost_reply)

    def publish(self, name: str, fragment: int, lost_reply: bool) -> None:
        node = self.nodes[name]
        learner = node.learner
        entry = learner.ledger[fragment]
        if not node.alive or entry.in_flight is not None or entry.since_base.steps < 1:
            return
        version = learner.versions[fragment]
        round = keys.round_of(fragment, version + 1, CONFIG.fragments)
        learner.ledger = learner.ledger.published(fragment, round)
        delta = self.bucket.put_blob(f"delta:{name}:{round}:{learner.total_steps}".encode())
        snapshot = Snapshot(
            learner=name,
            round=round,
            fragment=fragment,
            base_version=version,
            steps=entry.since_base.steps,
            tokens=entry.since_base.tokens,
            delta=delta,
            norm=1.0,
        )
        key = keys.snapshot(round, name)
        if not self._write_once(key, records.encode(snapshot), lost_reply):
            learner.ledger = learner.ledger.publish_failed(fragment)

    def receive(self, name: str, lag: int) -> None:
        node = self.nodes[name]
        learner = node.learner
        if not node.alive:
            return
        start = keys.record(learner.newest_round) if learner.newest_round >= 0 else ""
        for key in self.bucket.list(keys.RECORDS, lag):
            round = keys.parse_record(key)
            if round is None or key <= start:
                continue
            assert round == learner.newest_round + 1, "records/ skipped a round"
            record = self._record(round)
            assert record is not None
            learner.ledger, resolution = learner.ledger.recorded(record, name)
            if resolution is not None and resolution.outcome == "included":
                learner.included_steps += resolution.steps
            learner.versions[record.fragment] = max(
                learner.versions[record.fragment], record.version
            )
            learner.newest_round = round

    # -- the syncer -------------------------------------------------------------------------

    @rule(name=nodes, requests=st.integers(1, 6), lag=lags, lost_reply=st.booleans())
    def syncer(self, name: str, requests: int, lag: int, lost_reply: bool) -> None:
        """The syncer's next ``requests`` requests, whatever it is doing: looking at its
        round, waiting for the quorum of the round it holds, writing a blob, or writing the
        record; a step ends early once it has adopted or committed a round."""
        if not self.nodes[name].alive:
            return
        self._beat(name, self.nodes[name])
        start = self.nodes[name].syncer.next_round
        for _ in range(requests):
            closing = self.nodes[name].syncer.closing
            if closing is None:
                self.syncer_look(name, lag)
            elif len(closing.blobs) < _blobs_of(closing.round):
                self.write_blob(name)
            else:
                self.write_record(name, lost_reply)
            if self.nodes[name].syncer.next_round != start:
                return

    def syncer_look(self, name: str, lag: int) -> None:
        """One look of the syncer's round loop (``_run_round``) and the step it takes."""
        node = self.nodes[name]
        syncer = node.syncer
        if not node.alive or syncer.closing is not None:
            return
        held = syncer.held or RoundState(syncer.next_round, name, CLAIM_TIMEOUT)
        view = self._observe(syncer, held, lag)
        held, step = observed(held, view, self.now, CONFIG)
        syncer.held = held
        match step:
            case Adopt(record=record) if record is not None:
                if step.superseded:
                    event("superseded while closing")
                self._adopt(node, record)
            case Claim(k) | TakeOver(k, _):
                data = records.encode(RoundClaim(learner=name))
                if self.bucket.put_if_absent(keys.round_claim(held.round, k), data):
                    if isinstance(step, TakeOver):
                        event(f"takeover ({step.cause})")
                    syncer.held = held.claimed(self.now)
            case Commit(published=published):
                syncer.closing = Closing(held.round, self._draft(name, held.round, published))
            case Follow() | Wait() | Again():
                pass
            case _:
                raise AssertionError(f"unexpected step {step!r}")

    def _draft(self, name: str, round: int, published: frozenset[str]) -> RoundRecordDraft:
        """The closer's draft: every published snapshot that decodes, with equal weights."""
        participants = []
        for learner in sorted(published):
            data = self.bucket.get(keys.snapshot(round, learner))
            if data is None:
                continue
            try:
                snapshot = records.decode(data, Snapshot)
            except RecordError:
                continue
            participants.append(
                Participant(
                    learner=learner,
                    weight=1.0 / len(published),
                    steps=snapshot.steps,
                    tokens=snapshot.tokens,
                    base_version=snapshot.base_version,
                )
            )
        return RoundRecordDraft(
            round=round,
            fragment=keys.fragment_of(round, CONFIG.fragments),
            version=keys.version_of(round, CONFIG.fragments),
            committed_by=name,
            participants=tuple(participants),
            quorum_seconds=0.0,
            grace_seconds=0.0,
            cosine=None,
        )

    def write_blob(self, name: str) -> None:
        """The closer writes its next blob (the update; θ and the outer state first at a
        checkpoint): the record comes last."""
        node = self.nodes[name]
        closing = node.syncer.closing
        if not node.alive or closing is None or len(closing.blobs) == _blobs_of(closing.round):
            return
        what = ("theta", "outer", "update")[3 - _blobs_of(closing.round) + len(closing.blobs)]
        content = f"{what}:{closing.round}:{sorted(p.learner for p in closing.draft.participants)}"
        closing.blobs = (*closing.blobs, self.bucket.put_blob(content.encode()))

    def write_record(self, name: str, lost_reply: bool) -> None:
        node = self.nodes[name]
        closing = node.syncer.closing
        if not node.alive or closing is None or len(closing.blobs) < _blobs_of(closing.round):
            return
        *checkpoint, update = closing.blobs
        theta, outer = checkpoint if checkpoint else (None, None)
        ours = RoundRecord.committed(closing.draft, theta=theta, outer=outer, update=update)
        if self._write_once(keys.record(closing.round), records.encode(ours), lost_reply):
            node.committed.add(closing.round)
            event(f"committed a round >= {min(closing.round, 8)}")
            if lost_reply:
                event("a record whose reply was lost counted as ours")
            self._collect_garbage(closing.round)
            self._adopt(node, ours)
            return
        event("superseded at the record")
        landed = self._record(closing.round)
        assert landed is not None
        assert landed != ours
        self._adopt(node, landed)

    def _collect_garbage(self, round: int) -> None:
        """``collect_garbage`` after committing ``round``: what left ``retained``."""
        before, now = retained(round - 1, CONFIG), retained(round, CONFIG)
        doomed: list[str] = []
        for stale in sorted(before.snapshots - now.snapshots):
            prefix = self.bucket.list(keys.round_prefix(stale), 0)
            doomed += prefix
            for key in prefix:
                parsed = keys.parse_snapshot(key)
                data = self.bucket.get(key)
                if parsed is not None and data is not None:
                    try:
                        doomed.append(keys.blob(records.decode(data, Snapshot).delta.sha256))
                    except RecordError:
                        continue
        keep = {ref.sha256 for ref in self.theta0}
        for r in now.records:
            if (kept := self._record(r)) is not None:
                keep |= _shas(kept)
        for old in sorted(before.records - now.records):
            if (dropped := self._record(old)) is not None:
                doomed += [keys.blob(sha) for sha in sorted(_shas(dropped) - keep)]
                event("collected the blobs of an old record")
        self.bucket.delete(doomed)

    # -- invariants ---------------------------------------------------------------------------

    def _rounds(self) -> list[int]:
        return sorted(r for key in self.bucket.objects if (r := keys.parse_record(key)) is not None)

    @invariant()
    def records_are_contiguous_and_consistent(self) -> None:
        rounds = self._rounds()
        assert rounds == list(range(len(rounds)))
        for round in rounds:
            record = self._record(round)
            assert record is not None
            assert record.round == round
            assert record.fragment == keys.fragment_of(round, CONFIG.fragments)
            assert record.version == keys.version_of(round, CONFIG.fragments)

    @invariant()
    def one_record_per_round(self) -> None:
        for name, node in self.nodes.items():
            for round in node.committed:
                record = self._record(round)
                assert record is not None
                assert record.committed_by == name

    @invariant()
    def retained_blobs_exist_and_match(self) -> None:
        refs = list(self.theta0)
        rounds = self._rounds()
        for round in sorted(retained(rounds[-1], CONFIG).records) if rounds else []:
            record = self._record(round)
            assert record is not None
            refs += [ref for ref in (record.theta, record.outer, record.update) if ref]
        for ref in refs:
            data = self.bucket.get(keys.blob(ref.sha256))
            assert data is not None, f"blob {ref.sha256[:8]} of a retained record is gone"
            assert digest(data) == ref.sha256
            assert len(data) == ref.size

    @invariant()
    def no_step_counted_twice(self) -> None:
        for name, node in self.nodes.items():
            learner = node.learner
            for fragment in range(CONFIG.fragments):
                entry = learner.ledger[fragment]
                assert entry.balanced
                assert entry.committed.steps <= learner.total_steps
            assert learner.included_steps <= learner.total_steps * CONFIG.fragments
            included = [0] * CONFIG.fragments
            for round in self._rounds():
                record = self._record(round)
                assert record is not None
                included[record.fragment] += sum(
                    p.steps for p in record.participants if p.learner == name
                )
            taken = self.retired_steps[name] + (learner.total_steps if node.alive else 0)
            assert max(included) <= taken


ProtocolModel.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestProtocolModel = ProtocolModel.TestCase


INVARIANTS = (
    ProtocolModel.records_are_contiguous_and_consistent,
    ProtocolModel.one_record_per_round,
    ProtocolModel.retained_blobs_exist_and_match,
    ProtocolModel.no_step_counted_twice,
)


def test_long_random_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deep runs the shrinking search rarely reaches: seeded walks of the same machine, with
    the invariants checked after every step, that must commit many rounds, collect garbage
    and take rounds over on the way."""
    seen: Counter[str] = Counter()
    monkeypatch.setattr(sys.modules[__name__], "event", lambda text: seen.update([text]))
    committed = 0
    for seed in range(10):
        rng = random.Random(seed)
        machine = ProtocolModel()
        machine.start()
        for _ in range(250):
            name = rng.choice(NODES)
            lag = rng.choice([0, 0, 1, 2])
            lost = rng.random() < 0.2
            roll = rng.random()
            if roll < 0.35:
                publish = {f for f in range(CONFIG.fragments) if rng.random() < 0.7}
                machine.learn(name, lag, rng.randint(0, 3), rng.randint(0, 100), publish, lost)
            elif roll < 0.75:
                machine.syncer(name, rng.randint(1, 6), lag, lost)
            elif roll < 0.87:
                machine.tick(rng.choice([0.3, 0.3, 1.0, 2.5, 7.0]))
            elif roll < 0.9:
                machine.beat(name)
            elif roll < 0.93:
                machine.crash(name)
            elif roll < 0.95:
                machine.forge(rng.randint(0, 2), rng.random() < 0.5)
            else:
                machine.restart(name, lag)
            for check in INVARIANTS:
                check(machine)
        committed += len(machine._rounds())
    print(f"random walks: {committed} rounds committed; {dict(seen)}")
    assert committed >= 10 * 8, committed
    assert seen["collected the blobs of an old record"] > 0
    assert seen["takeover (lease_gone)"] + seen["takeover (no_record)"] > 0
    assert seen["a record whose reply was lost counted as ours"] > 0
    assert seen["superseded at the record"] > 0


def _blobs_of(round: int) -> int:
    """How many blobs round ``round``'s closer writes: the update, and θ and the outer state
    at a checkpoint."""
    return 3 if is_checkpoint(keys.version_of(round, CONFIG.fragments), CONFIG) else 1


def _shas(record: RoundRecord) -> set[str]:
    return {ref.sha256 for ref in (record.theta, record.outer, record.update) if ref}
