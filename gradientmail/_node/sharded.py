"""One rank of a sharded learner group (FSDP2; ``docs/node.md``, "Learner groups"): the rows
of each fragment it holds, the versions it has prepared for the group's next tick, and the
parts of snapshots that travel between its ranks at ticks.

Every rank of a sharded group runs its own ``protocol.learner.Learner`` over its own rows;
the leader's learner takes the inputs and every follower replays them from the leader's log
(``protocol.group``). A ``ShardedRank`` is used on its node's event-loop thread only: by the
receive task (``prepare``), the publisher (``report``, ``gathered``) and the group's tick,
whose collectives run in a worker thread and whose two ends (``_node.ticks.Ticks``) hop
back onto the loop.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import msgspec
from torch import Tensor

from gradientmail._node.model_parameters import by_fragment
from gradientmail.errors import MailboxUnavailable
from gradientmail.protocol.group import Gathered, PartReport
from gradientmail.protocol.layout import Rows
from gradientmail.protocol.records import Manifest, ParamSpec

__all__ = ["Layout", "ShardedRank", "squares"]


class ShardedRank:
    """Rank ``rank`` of ``world``: ``rows[f]`` are its rows of each parameter of fragment
    ``f`` (``layout.Rows``)."""

    def __init__(self, rank: int, world: int, rows: Sequence[Rows]) -> None:
        self.rank = rank
        self.world = world
        self.rows = tuple(rows)
        self._prepared: dict[int, tuple[int, tuple[Tensor, ...]]] = {}
        self._outbox: list[PartReport] = []
        self._gathering: dict[tuple[int, int], Gathered] = {}
        self._ended: dict[int, int] = {}
        self._arrived = anyio.Event()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- versions --------------------------------------------------------------------------

    def prepare(self, fragment: int, round: int, theta: tuple[Tensor, ...]) -> None:
        """This rank's rows of the version of ``round``'s record of ``fragment`` are ready
        (replacing an older one: the learner wants one version of a fragment at a time)."""
        self._prepared[fragment] = (round, theta)

    def prepared(self, fragment: int) -> int | None:
        """The round of the version of ``fragment`` prepared, None for none."""
        held = self._prepared.get(fragment)
        return None if held is None else held[0]

    def take(self, fragment: int, round: int) -> tuple[Tensor, ...]:
        """The prepared rows of ``round``'s version of ``fragment``, no longer kept. Raises
        ``RuntimeError`` when this rank lacks them: the group's readiness said every rank
        had them, so the ranks are out of step (a bug)."""
        held = self._prepared.get(fragment)
        if held is None or held[0] != round:
            raise RuntimeError(
                f"learner group, rank {self.rank}: the version of round {round} of fragment "
                f"{fragment} is ready on every rank but not prepared here"
            )
        del self._prepared[fragment]
        return held[1]

    # -- the parts of a snapshot -----------------------------------------------------------

    def report(self, report: PartReport) -> None:
        """This rank's part is uploaded: a follower sends it at its next tick, the leader
        gathers it with the others'."""
        if self.leader:
            self.arrived([report])
        else:
            self._outbox.append(report)

    def outgoing(self) -> list[PartReport]:
        """The reports to send at this tick (none are kept)."""
        reports, self._outbox = self._outbox, []
        return reports

    def arrived(self, reports: Sequence[PartReport]) -> None:
        """Reports gathered at a tick (the leader's). One for a snapshot whose publish has
        ended (a follower that reported after the leader's own upload failed) is ignored."""
        for report in reports:
            key = (report.round, report.fragment)
            if report.round <= self._ended.get(report.fragment, -1):
                continue
            self._gathering[key] = self._gathering.get(key, Gathered.empty(self.world)).add(report)
        self._arrived.set()
        self._arrived = anyio.Event()

    async def gathered(self, round: int, fragment: int) -> Gathered:
        """Every rank's part of the snapshot of ``fragment`` for ``round``, once all have
        reported: as long as that takes, as a single learner's upload takes as long as its
        store does (a part's report travels at its rank's next ``step()``, so a pause in
        training pauses this too). Raises ``MailboxUnavailable`` as soon as a rank reports
        that its upload failed (the snapshot's steps go out with the fragment's next one)."""
        key = (round, fragment)
        while True:
            found = self._gathering.get(key, Gathered.empty(self.world))
            if found.failed:
                raise MailboxUnavailable(
                    f"ranks {list(found.failed)} of the learner group could not upload their "
                    f"parts of round {round} (fragment {fragment}); see their PublishFailed"
                )
            if found.complete:
                return found
            await self._arrived.wait()

    def end(self, round: int, fragment: int) -> None:
        """The leader's publish of ``fragment`` for ``round`` has ended: its reports, and
        any that arrive for it or an earlier round of the fragment, are not kept."""
        self._ended[fragment] = max(round, self._ended.get(fragment, -1))
        for stale in [k for k in self._gathering if k[1] == fragment and k[0] <= round]:
            del self._gathering[stale]


def squares(norm: float | None) -> float | None:
    """A part's squared norm from its norm (None when not finite)."""
    return None if norm is None or not math.isfinite(norm) else norm * norm


@dataclass(frozen=True, slots=True)
class Layout:
    """A sharded rank's model: each parameter's local rows (``local``, written in place)
    and which rows of the whole they are (``rows``), by name (``_node.model_parameters.shards``)."""

    local: dict[str, Tensor]
    rows: dict[str, tuple[int, int]]

    def params(self, manifest: Manifest) -> tuple[tuple[Tensor, ...], ...]:
        """The local rows of each fragment's parameters, in its ``spec.params`` order (of a
        parameter split by rows between fragments, those of the fragment's part)."""
        return by_fragment(manifest, self._local)

    def fragment_rows(self, manifest: Manifest) -> tuple[Rows, ...]:
        """This rank's ``layout.Rows`` of each fragment (of a parameter split by rows between
        fragments, counted within the fragment's part)."""
        return by_fragment(manifest, self._rows)

    def _rows(self, param: ParamSpec) -> tuple[int, int]:
        start, end = self.rows[param.name]
        if isinstance(param.start, msgspec.UnsetType):
            return start, end
        # The rank's rows clamped to the part: ranks before it hold none of it at its start,
        # ranks after it none at its end, so the ranks' ranges still tile the part in order.
        count = param.shape[0]
        low = min(max(start - param.start, 0), count)
        return low, max(min(max(end - param.start, 0), count), low)

    def _local(self, param: ParamSpec) -> Tensor:
        local = self.local[param.name]
        if isinstance(param.start, msgspec.UnsetType):
            return local
        low, high = self._rows(param)
        if low == high:
            return local.narrow(0, 0, 0)
        return local.narrow(0, param.start + low - self.rows[param.name][0], high - low)
