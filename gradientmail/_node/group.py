"""A learner group: the ranks of one ``torch.distributed`` process group training one
learner together (``docs/node.md``, "Learner groups").

Rank 0 of the group (the *leader*) is the node the run sees: it joins the run, beats the
lease, lists the records, and syncs when it is a syncer. Every rank enters
``gradientmail.node(..., group=pg)`` and calls ``step()`` as often as the others, with the
same tokens.

- Replicated parameters (DDP): the followers never touch the store. Each ``step()`` is the
  leader's learner step, one control exchange (``protocol.group``: the leader's decision,
  every rank's place and tokens) and, when the decision changed a fragment's version, a
  broadcast of that fragment's parameters from the leader, so every rank holds the same
  bits after every ``step()``.
- Sharded parameters (FSDP2, ``_node.sharded``): every rank runs its own learner over its
  own rows and moves its own rows' bytes. Each ``step()`` is a *tick*: the leader's learner
  step, then the control exchange (which also carries the leader's step and the versions
  each rank has prepared), then only when there is something to send, the leader's log
  broadcast (every other input its learner took since the last tick, which each follower
  replays on its own rows) and an all-gather of the ranks' part reports. The close ticks
  too, until the leader's close has ended.

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
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from gradientmail._node.learner import LearnerDriver
from gradientmail._node.model import by_fragment
from gradientmail._node.sharded import ShardedRank
from gradientmail._node.state import NodeState
from gradientmail.errors import GroupFailed, RunMismatch
from gradientmail.protocol.fragments import window
from gradientmail.protocol.group import (
    Decision,
    Entry,
    Kind,
    Message,
    PartReport,
    Stepped,
    Summed,
    all_ready,
    contribution,
    decode_log,
    encode_log,
    read,
    verdict,
)
from gradientmail.protocol.records import Manifest, decode, encode
from gradientmail.reader import check_model

__all__ = ["GroupLink", "GroupMember", "Outgoing", "Ticks", "fragment_params", "link_of"]

_reports_decoder = msgspec.msgpack.Decoder(list[PartReport])

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
    """The live parameters of each fragment of ``manifest``, in its ``spec.params`` order
    (a parameter split by rows: a view of its rows, ``fragments.window``)."""
    by_name = dict(named)
    return by_fragment(manifest, lambda p: window(by_name[p.name], p))


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

    def share_bytes(self, data: bytes, size: int) -> bytes:
        """The leader's ``data`` of ``size`` bytes (the size the control exchange carried),
        on every rank."""
        if size == 0:
            return b""
        if self.leader:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(size, dtype=torch.uint8)
        work = dist.broadcast(buffer, src=self.src, group=self.group, async_op=True)
        self._wait(work, True, "the log's broadcast")
        if self.leader:
            self.sent += size
            return data
        self.received += size
        return buffer.numpy().tobytes()

    def gather_reports(self, reports: Sequence[PartReport]) -> list[PartReport]:
        """Every rank's ``reports``, in rank order."""
        data = msgspec.msgpack.encode(list(reports))
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        work = dist.all_gather(sizes, size, group=self.group, async_op=True)
        self._wait(work, True, "the part reports' exchange")
        longest = max(int(s.item()) for s in sizes)
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        work = dist.all_gather(gathered, buffer, group=self.group, async_op=True)
        self._wait(work, True, "the part reports' exchange")
        self.sent += len(data)
        found: list[PartReport] = []
        for rank, (count, part) in enumerate(zip(sizes, gathered, strict=True)):
            if rank != self.rank:
                self.received += int(count.item())
            found.extend(_reports_decoder.decode(part[: int(count.item())].numpy().tobytes()))
        return found

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

    def tick_with(self, ticks: "Ticks") -> None:
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

    async def _close_sharded(self, flush: Callable[[], Awaitable[None]], ticks: "Ticks") -> None:
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

    def __init__(self, driver: LearnerDriver, rank: ShardedRank, log: list[Entry] | None) -> None:
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
            driver.version_ready(fragment, round, rank.take(fragment, round))

    def current(self, ok: bool) -> Decision:
        """The leader's decision as it stands, for the result of the close."""
        return replace(Decision.of(self._driver.state), ok=ok)


async def lead(
    link: GroupLink, manifest: Manifest, learner: str, member: GroupMember, *, share: bool = True
) -> None:
    """The leader's entry, once it has joined the run: send the manifest and the decision,
    wait for every follower's check (a sharded follower's: and its rows loaded), then
    (``share``: replicated parameters) send every parameter."""
    view = member.view
    payload = ("joined", learner, encode(manifest), view.versions, view.round, view.aligned)
    await anyio.to_thread.run_sync(link.share_object, payload)
    fragments = manifest.config.fragments
    await anyio.to_thread.run_sync(link.control, Message("enter", 0), "enter", fragments)
    if share:
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


Load = Callable[[Manifest, tuple[int, ...], int], Awaitable[Params]]
"""A sharded follower's loading of its rows of the leader's versions (the manifest, the
versions, the newest round): its live rows of each fragment."""


async def gather_whole(
    link: GroupLink, named: Sequence[tuple[str, Tensor]], names: list[str]
) -> list[Tensor]:
    """The leader of a sharded group creating the run: the parameters ``names`` whole,
    gathered from every rank (``DTensor.full_tensor``, the followers taking part in
    ``follow``), in a worker thread."""
    await anyio.to_thread.run_sync(link.share_object, ("gather", names))
    return await anyio.to_thread.run_sync(_full_tensors, named, names)


def _full_tensors(named: Sequence[tuple[str, Tensor]], names: Sequence[str]) -> list[Tensor]:
    by_name = dict(named)
    return [by_name[name].full_tensor() for name in names]  # type: ignore[attr-defined]


async def follow(
    link: GroupLink, learner: str, named: Sequence[tuple[str, Tensor]], load: Load | None = None
) -> tuple[Manifest, GroupMember]:
    """A follower's entry: the leader's manifest and decision, this model checked against
    it (a mismatch aborts the group's entry and raises here: ``RunMismatch``/``ValueError``),
    then the leader's parameters copied into this model, or (a sharded group) this rank's
    rows of the leader's versions read from the store by ``load`` (what it raises aborts
    the entry too). While a sharded leader creates the run, this rank takes part in
    gathering each fragment whole (``gather_whole``)."""
    payload = await anyio.to_thread.run_sync(link.share_object, None)
    while payload[0] == "gather":
        await anyio.to_thread.run_sync(_full_tensors, named, payload[1])
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
    params: Params = ()
    if problem is None:
        # A sharded rank's parameters are DTensors: a window of one would be a collective
        # the other ranks are not in, so its rows come from ``load`` instead.
        try:
            params = (
                fragment_params(manifest, named)
                if load is None
                else await load(manifest, versions, round)
            )
        except Exception as exc:
            problem = exc
    fragments = manifest.config.fragments
    message = Message("abort" if problem is not None else "enter", link.rank)
    await anyio.to_thread.run_sync(link.control, message, "enter", fragments)
    if problem is not None:
        link.broken = True
        raise problem
    member = GroupMember(link, params, Decision(versions, round, aligned))
    if load is None:
        await anyio.to_thread.run_sync(link.share, [p for group in member.params for p in group])
    return manifest, member
