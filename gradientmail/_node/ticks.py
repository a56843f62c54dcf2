"""The two ends of a sharded learner group's tick on one rank (``_node.group_member``): what the
rank brings to the control exchange (``Outgoing``) and what it does with the outcome
(``Ticks``), on its node's event-loop thread."""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gradientmail._node.learner_driver import LearnerDriver
from gradientmail._node.sharded import ShardedRank
from gradientmail.protocol.group import (
    Decision,
    PartReport,
    Summed,
    all_ready,
    decode_log,
    encode_log,
)
from gradientmail.protocol.learner_inputs import Input, Stepped, VersionReady

__all__ = ["Outgoing", "Ticks"]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What a rank brings to a tick: the leader's decision (None on a follower) and log
    bytes, its part reports and the round of the version of each fragment it has
    prepared."""

    decision: Decision | None
    log: bytes
    reports: list[PartReport]
    prepared: tuple[int | None, ...]


class Ticks:
    """The two ends of a sharded group's tick on one rank, on its event-loop thread:
    ``before`` (the leader steps its learner and takes its log) and ``after`` (a follower
    replays the log; the leader gathers reports and feeds the versions every rank holds).
    ``log`` is the leader's driver's record (``LearnerDriver.record``), None on a follower."""

    def __init__(self, driver: LearnerDriver, rank: ShardedRank, log: list[Input] | None) -> None:
        self._driver = driver
        self._rank = rank
        self._log = log

    def before(self, tokens: int | None, closing: bool) -> Outgoing:
        """This rank's part of a tick; on the leader, first its learner's step of ``tokens``
        (None: a tick of the close, no step)."""
        driver, rank = self._driver, self._rank
        prepared = tuple(rank.prepared(f) for f in range(len(rank.rows)))
        if self._log is None:
            return Outgoing(None, b"", rank.outgoing(), prepared)
        now = 0.0
        if tokens is not None:
            driver.step(tokens)
            stepped = self._log.pop()
            assert isinstance(stepped, Stepped)  # the step is its learner's last input
            now = stepped.now
        data = encode_log(self._log)
        self._log.clear()
        decision = replace(
            Decision.of(driver.state, tokens or 0), log=len(data), closing=closing, now=now
        )
        return Outgoing(decision, data, [], prepared)

    def after(
        self, summed: Summed, stepped: bool, log: bytes, reports: Sequence[PartReport]
    ) -> None:
        """The tick's outcome (``summed``; ``stepped``: a ``step()``'s tick), the leader's
        ``log``, the reports of every rank: a follower replays the log, then the leader's
        step; the leader gathers the reports and feeds the versions every rank holds."""
        driver, rank = self._driver, self._rank
        if self._log is None:
            decision = summed.decision
            assert decision is not None
            entries = decode_log(log)
            driver.replay([*entries, decision.stepped] if stepped else entries, rank.take)
            return
        rank.arrived(reports)
        wanted: list[int | None] = [None] * len(rank.rows)
        for download in driver.state.downloads():
            wanted[download.fragment] = download.record.round
        for fragment in all_ready(summed, wanted, rank.world):
            round = wanted[fragment]
            assert round is not None
            driver.feed(VersionReady(fragment, round, rank.take(fragment, round)))

    def current(self, ok: bool) -> Decision:
        """The leader's decision as it stands, for the result of the close."""
        return replace(Decision.of(self._driver.state), ok=ok)
