"""A learner group: the ranks of one ``torch.distributed`` process group training one
learner together (data-parallel, replicated parameters; ``docs/node.md``, "Learner groups").

Rank 0 of the group (the *leader*) is the node the run sees: it joins the run, beats the
lease, receives, publishes, and syncs when it is a syncer. The other ranks (*followers*)
never touch the store. Every rank enters ``gradientmail.node(..., group=pg)`` and calls
``step()`` as often as the others, with the same tokens; each ``step()`` is the leader's
learner step, one control exchange (``protocol.group``: the leader's decision, every rank's
place and tokens) and, when the decision changed a fragment's version, a broadcast of that
fragment's parameters from the leader, so every rank holds the same bits after every
``step()``.

Threads: ``GroupLink``'s methods block on collectives and run in ``anyio.to_thread``
worker threads only; the leader's learner step hops back onto the event loop from there
(``anyio.from_thread.run``). No collective runs on the event-loop thread.

Failure: a control exchange that finds a rank gone, out of step or aborting raises
``GroupFailed`` on every rank that takes part in it; a collective that does not complete
within ``NodeOptions.group_timeout`` (or whose peer's connection closed: a dead rank)
raises ``GroupFailed`` too. A rank leaving its block by an exception sends an abort, which
completes whatever exchange the others wait in. The waits that include the leader's store
work (entering, the leader's close) are bounded by the process group's own timeout instead.
"""

import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import torch
import torch.distributed as dist
from torch import Tensor

from gradientmail._node.state import NodeState
from gradientmail.errors import GroupFailed, RunMismatch
from gradientmail.protocol.group import Decision, Kind, Message, Summed, contribution, read, verdict
from gradientmail.protocol.records import Manifest, decode, encode
from gradientmail.reader import check_model

__all__ = ["GroupLink", "GroupMember", "fragment_params", "link_of"]

_log = logging.getLogger("gradientmail.group")

Params = tuple[tuple[Tensor, ...], ...]


def link_of(group: object, timeout: float, *, model: bool) -> "GroupLink | None":
    """The link of this rank to ``group`` (None for no group, or a group of one rank).
    Raises ``TypeError``/``ValueError`` naming what to fix for anything that is not an
    initialized gloo process group, or for a rank without a ``model``."""
    if group is None:
        return None
    if not model:
        raise ValueError("every rank of a learner group (group=) passes its model")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group= needs torch.distributed initialized (dist.init_process_group) on every rank"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {group!r}")
    backend = dist.get_backend(group)
    if backend != "gloo":
        raise ValueError(
            f"group is a {backend!r} process group; a learner group exchanges CPU tensors: "
            "pass dist.new_group(backend='gloo') (your model may keep its own NCCL group)"
        )
    if dist.get_world_size(group) == 1:
        return None
    return GroupLink(group, timeout)


def fragment_params(manifest: Manifest, named: Sequence[tuple[str, Tensor]]) -> Params:
    """The live parameters of each fragment of ``manifest``, in its ``spec.params`` order."""
    by_name = dict(named)
    return tuple(tuple(by_name[p.name] for p in spec.params) for spec in manifest.fragments)


class GroupLink:
    """This rank's end of its learner group. Every method but ``leader`` blocks on a
    collective: call it from a worker thread, never from the event-loop thread. ``sent`` and
    ``received`` count the payload bytes of the collectives (control vectors and the
    fragments broadcast), not the transport's own."""

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0)
        self.timeout = timedelta(seconds=timeout)
        self.broken = False
        self.sent = 0
        self.received = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def control(
        self, message: Message, expected: Kind, fragments: int, *, bounded: bool = True
    ) -> Summed:
        """Exchange ``message``; the group's sum. Raises ``GroupFailed`` when a rank aborted,
        the ranks are out of step, or the exchange failed or timed out (``bounded``: within
        ``group_timeout``, else the process group's own timeout). An abort is never judged:
        it only completes the exchange the others wait in."""
        values = torch.tensor(contribution(message, fragments), dtype=torch.int64)
        work = dist.all_reduce(values, group=self.group, async_op=True)
        self._wait(work, bounded, f"the {expected} exchange")
        self.sent += values.nbytes
        self.received += values.nbytes
        summed = read(values.tolist(), fragments)
        if message.kind == "abort":
            return summed
        problem = verdict(summed, expected, self.world)
        if problem is not None:
            self.broken = True
            raise GroupFailed(f"learner group, rank {self.rank}: {problem}")
        return summed

    def share(self, tensors: Sequence[Tensor]) -> None:
        """Broadcast ``tensors`` from the leader; a follower's are overwritten in place
        (staged through a CPU copy when they are not contiguous CPU tensors)."""
        for tensor in tensors:
            buffer = tensor.detach()
            staged = buffer.device.type != "cpu" or not buffer.is_contiguous()
            if staged:
                buffer = buffer.to("cpu", copy=True).contiguous()
            work = dist.broadcast(buffer, src=self.src, group=self.group, async_op=True)
            self._wait(work, True, "a fragment's broadcast")
            if self.leader:
                self.sent += buffer.nbytes
            else:
                self.received += buffer.nbytes
                if staged:
                    with torch.no_grad():
                        tensor.copy_(buffer)

    def share_object(self, value: Any) -> Any:
        """The leader's ``value`` (picklable), on every rank; bounded by the process
        group's own timeout (the leader may still be joining the run)."""
        box = [value if self.leader else None]
        try:
            dist.broadcast_object_list(box, src=self.src, group=self.group)
        except RuntimeError as exc:
            raise self._failed("the entry exchange", exc) from exc
        return box[0]

    def _wait(self, work: Any, bounded: bool, what: str) -> None:
        try:
            if bounded:
                work.wait(timeout=self.timeout)
            else:
                work.wait()
        except RuntimeError as exc:  # gloo's timeout, and a peer's closed connection
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: RuntimeError) -> GroupFailed:
        self.broken = True
        return GroupFailed(
            f"learner group, rank {self.rank}: {what} did not complete ({exc}); a rank died, "
            f"hung or left (waited up to {self.timeout.total_seconds():g} s, "
            "NodeOptions.group_timeout)"
        )


class GroupMember:
    """One rank's part in its learner group, held by its ``Node``; the leader's node
    ``attach``es its learner before the first step."""

    def __init__(self, link: GroupLink, params: Params, view: Decision) -> None:
        self.link = link
        self.params = params
        self.view = view
        self.steps = 0
        self.tokens = 0
        self._decide: Callable[[int], Coroutine[Any, Any, Decision]] | None = None
        self._current: Callable[[], Decision] | None = None
        self._fragments = len(view.versions)

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
        """``step_in_thread`` in a worker thread."""
        await anyio.to_thread.run_sync(self.step_in_thread, tokens)

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
            with anyio.CancelScope(shield=True):
                summed = await anyio.to_thread.run_sync(
                    lambda: link.control(
                        Message("result", link.rank, decision=decision),
                        "result",
                        fragments,
                        bounded=False,
                    )
                )
        assert summed.decision is not None
        if not summed.decision.ok:
            link.broken = True
            raise GroupFailed("learner group: the leader's close failed (see its events)")
        await anyio.to_thread.run_sync(self._adopt, summed.decision)

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
        leader = self._decide is not None
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


async def lead(link: GroupLink, manifest: Manifest, learner: str, member: GroupMember) -> None:
    """The leader's entry, once it has joined the run: send the manifest and the decision,
    wait for every follower's check, send every parameter."""
    view = member.view
    payload = ("joined", learner, encode(manifest), view.versions, view.round, view.aligned)
    await anyio.to_thread.run_sync(link.share_object, payload)
    fragments = manifest.config.fragments
    await anyio.to_thread.run_sync(link.control, Message("enter", 0), "enter", fragments)
    await anyio.to_thread.run_sync(link.share, [p for group in member.params for p in group])


async def refuse(link: GroupLink, exc: Exception) -> None:
    """The leader could not join the run (``exc``): tell the followers, which raise
    ``GroupFailed`` naming it."""
    with anyio.CancelScope(shield=True):
        try:
            await anyio.to_thread.run_sync(
                link.share_object, ("failed", f"{type(exc).__name__}: {exc}")
            )
        except GroupFailed as failed:
            _log.warning("%s", failed)


async def follow(
    link: GroupLink, learner: str, named: Sequence[tuple[str, Tensor]]
) -> tuple[Manifest, GroupMember]:
    """A follower's entry: the leader's manifest and decision, this model checked against
    it (a mismatch aborts the group's entry and raises here: ``RunMismatch``/``ValueError``),
    then the leader's parameters copied into this model."""
    payload = await anyio.to_thread.run_sync(link.share_object, None)
    if payload[0] == "failed":
        link.broken = True
        raise GroupFailed(f"learner group: the leader (rank 0) could not join: {payload[1]}")
    _, theirs, data, versions, round, aligned = payload
    manifest = decode(data, Manifest)
    problem: Exception | None = None
    try:
        if theirs != learner:
            raise ValueError(
                f"rank {link.rank} passed learner={learner!r}, the leader {theirs!r}: every "
                "rank of a group passes the same learner id"
            )
        check_model(manifest, named)
    except (ValueError, RunMismatch) as exc:
        problem = exc
    fragments = manifest.config.fragments
    message = Message("abort" if problem is not None else "enter", link.rank)
    await anyio.to_thread.run_sync(link.control, message, "enter", fragments)
    if problem is not None:
        link.broken = True
        raise problem
    member = GroupMember(link, fragment_params(manifest, named), Decision(versions, round, aligned))
    await anyio.to_thread.run_sync(link.share, [p for group in member.params for p in group])
    return manifest, member
