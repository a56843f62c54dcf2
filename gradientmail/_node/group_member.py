"""A learner group: the ranks of one ``torch.distributed`` process group training one
learner together (``docs/node.md``, "Learner groups").

Rank 0 (the *leader*) is the node the run sees: it joins the run, beats the lease, lists the
records and syncs when it is a syncer. Every rank enters ``gradientmail.node(..., group=pg)``
and calls ``step()`` as often as the others, with the same tokens. With replicated
parameters (DDP) the followers never touch the store and every rank holds the same bits
after every ``step()``; with sharded ones (FSDP2, ``_node.sharded``) every rank runs its own
learner over its own rows, kept in step by the leader's log. The modules: this rank's
membership (``GroupMember``, here), its collectives (``_node.group_link``), a sharded
group's tick (``_node.ticks``) and the group's entry (``_node.group_entry``).

Threads: collectives run in ``anyio.to_thread`` worker threads only, never on the
event-loop thread; the leader's learner step hops back onto the event loop from there
(``anyio.from_thread.run``).

Failure: an exchange that finds a rank gone, out of step or aborting, and a collective that
does not complete within ``NodeOptions.group_timeout`` (or whose peer's connection closed),
raise ``GroupFailed`` on every rank in it; a rank leaving its block by an exception sends an
abort that completes whatever exchange the others wait in. The waits that include the
leader's store work (entering, the leader's close) are bounded by the process group's own
timeout instead.
"""

import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
from torch import Tensor

from gradientmail._node.group_link import GroupLink
from gradientmail._node.model_parameters import by_fragment
from gradientmail._node.state import NodeState
from gradientmail._node.ticks import Ticks
from gradientmail.errors import GroupFailed
from gradientmail.protocol.fragments import window
from gradientmail.protocol.group import (
    Decision,
    Message,
)
from gradientmail.protocol.records import Manifest

__all__ = ["GroupMember", "Params", "fragment_params"]

_log = logging.getLogger("gradientmail.group")

Params = tuple[tuple[Tensor, ...], ...]


def fragment_params(manifest: Manifest, named: Sequence[tuple[str, Tensor]]) -> Params:
    """The live parameters of each fragment of ``manifest``, in its ``spec.params`` order
    (a parameter split by rows: a view of its rows, ``fragments.window``)."""
    by_name = dict(named)
    return by_fragment(manifest, lambda p: window(by_name[p.name], p))


class GroupMember:
    """One rank's part in its learner group, held by its ``Node``; the leader's node
    ``attach``es its learner before the first step, and in a sharded group every rank's
    node gives its ``Ticks`` (``tick_with``)."""

    def __init__(self, link: GroupLink, params: Params, view: Decision) -> None:
        self.link = link
        self.params = params
        self.view = view
        self.steps = 0
        self.tokens = 0
        self._decide: Callable[[int], Coroutine[Any, Any, Decision]] | None = None
        self._current: Callable[[], Decision] | None = None
        self._ticks: Ticks | None = None
        self._fragments = len(view.versions)

    @property
    def sharded(self) -> bool:
        return self._ticks is not None

    def tick_with(self, ticks: Ticks) -> None:
        """A sharded group: each ``step()`` and each turn of the close is a tick of
        ``ticks``."""
        self._ticks = ticks

    def attach(
        self,
        decide: Callable[[int], Coroutine[Any, Any, Decision]],
        current: Callable[[], Decision],
    ) -> None:
        """The leader's learner: ``decide`` runs its step on the event loop with the
        learner's tokens and answers the decision; ``current`` answers the decision as it
        stands."""
        self._decide = decide
        self._current = current

    def step_in_thread(self, tokens: int) -> None:
        """One ``step()`` of the group, from a worker thread: the leader runs the learner's
        step with ``tokens`` (the learner's, the same on every rank), then one exchange
        brings its decision to every rank, which adopts it. Raises ``GroupFailed`` (every
        rank), or on the leader what its learner step raised (then its abort reaches the
        others)."""
        link = self.link
        decision: Decision | None = None
        if self._decide is not None:
            decision = anyio.from_thread.run(self._decide, tokens)
        message = Message("step", link.rank, tokens, decision)
        decided = link.control(message, "step", self._fragments)
        assert decided.decision is not None  # the verdict requires it
        self._adopt(decided.decision)
        self.steps += 1
        self.tokens += tokens

    async def step(self, tokens: int) -> None:
        """``step_in_thread`` (a sharded group: ``tick_in_thread``) in a worker thread."""
        if self._ticks is not None:
            await anyio.to_thread.run_sync(self.tick_in_thread, tokens)
        else:
            await anyio.to_thread.run_sync(self.step_in_thread, tokens)

    def tick_in_thread(self, tokens: int | None, closing: bool = False) -> Decision:
        """One tick of a sharded group, from a worker thread (see the module docstring):
        ``tokens`` for a ``step()`` (None: a turn of the close, the leader saying whether
        its close goes on: ``closing``). The leader's decision. Raises ``GroupFailed``
        (every rank), or on the leader what its learner step raised."""
        link, ticks = self.link, self._ticks
        assert ticks is not None
        out = anyio.from_thread.run_sync(ticks.before, tokens, closing)
        message = Message(
            "step",
            link.rank,
            tokens or 0,
            out.decision,
            reports=bool(out.reports),
            prepared=out.prepared,
        )
        summed = link.control(message, "step", self._fragments)
        decision = summed.decision
        assert decision is not None  # the verdict requires it
        log = link.share_bytes(out.log, decision.log)
        reports = link.gather_reports(out.reports) if summed.reports else []
        anyio.from_thread.run_sync(ticks.after, summed, tokens is not None, log, reports)
        self.view = decision
        if tokens is not None:
            self.steps += 1
            self.tokens += tokens
        return decision

    async def closing_tick(self) -> None:
        """A turn of the sharded leader's close: tick, its close going on."""
        await anyio.to_thread.run_sync(self.tick_in_thread, None, True)

    async def close(self, flush: Callable[[], Awaitable[None]]) -> None:
        """Leave together: every rank closes, the leader flushes (``flush``, the node's
        close) and sends how it ended, and every rank ends on the leader's parameters.
        Raises ``GroupFailed`` on a follower whose leader's close failed; the leader raises
        what ``flush`` raised."""
        link = self.link
        fragments = self._fragments
        await anyio.to_thread.run_sync(
            link.control, Message("close", link.rank), "close", fragments
        )
        if self._ticks is not None:
            await self._close_sharded(flush, self._ticks)
            return
        decision: Decision | None = None
        try:
            if self._current is not None:
                ok = False
                try:
                    await flush()
                    ok = True
                finally:
                    decision = replace(self._current(), ok=ok)
        finally:
            decided = await self._result(decision)
        await anyio.to_thread.run_sync(self._adopt, decided)

    async def _close_sharded(self, flush: Callable[[], Awaitable[None]], ticks: Ticks) -> None:
        """``close`` of a sharded group: the leader flushes (its turns tick, with
        ``closing_tick``) and ticks once more to say it has ended; a follower ticks until
        then. No parameters travel: every rank replayed the close on its own rows."""
        link = self.link
        ok = False
        try:
            if link.leader:
                try:
                    await flush()
                    ok = True
                finally:
                    if not link.broken:
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(self.tick_in_thread, None, False)
            else:
                while (await anyio.to_thread.run_sync(self.tick_in_thread, None, False)).closing:
                    pass
                ok = True
        finally:
            # A failed exchange broke the group: every rank is already raising GroupFailed.
            if not link.broken:
                await self._result(ticks.current(ok) if link.leader else None)

    async def _result(self, decision: Decision | None) -> Decision:
        """The close's last exchange (shielded; bounded by the process group's own
        timeout, as the leader's close may take long): the leader's ``decision`` (how its
        close ended), on every rank. Raises ``GroupFailed`` on a follower whose leader's
        close failed."""
        link = self.link
        with anyio.CancelScope(shield=True):
            summed = await anyio.to_thread.run_sync(
                lambda: link.control(
                    Message("result", link.rank, decision=decision),
                    "result",
                    self._fragments,
                    bounded=False,
                )
            )
        assert summed.decision is not None
        if not summed.decision.ok and decision is None:
            link.broken = True
            raise GroupFailed("learner group: the leader's close failed (see its events)")
        return summed.decision

    async def abort(self) -> None:
        """This rank leaves by an exception: complete the others' pending exchange with an
        abort (shielded, bounded by ``group_timeout``), unless the group already failed."""
        link = self.link
        if link.broken:
            return
        link.broken = True
        message = Message("abort", link.rank)
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(link.control, message, "abort", self._fragments)
            except GroupFailed as exc:
                _log.warning("%s", exc)

    def state(self, base: NodeState) -> NodeState:
        """``base`` as the group sees it: the decided versions and rounds (the same on every
        rank), this rank and its collectives' bytes; the steps and tokens the leader's
        learner counted (``base``'s) on the leader, the decided ones on a follower."""
        view = self.view
        leader = self._decide is not None or self._ticks is not None
        return replace(
            base,
            round=view.round,
            versions=view.versions,
            aligned_round=view.aligned,
            steps=base.steps if leader else self.steps,
            tokens=base.tokens if leader else self.tokens,
            rank=self.link.rank,
            world=self.link.world,
            group_bytes_sent=self.link.sent,
            group_bytes_received=self.link.received,
        )

    def _adopt(self, decision: Decision) -> None:
        changed = decision.changed(self.view)
        self.link.share([p for f in changed for p in self.params[f]])
        self.view = decision
