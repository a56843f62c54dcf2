"""Entering a run: creating or joining it (``_node.run_creation``), loading the newest committed
weights into the model, and a learner group's entry (``_node.group_member``: its leader joins and
brings its followers in; the followers take the leader's manifest and weights, or in a
sharded group read their own rows of the leader's versions: ``_node.group_entry``). A
sharded group's leader that creates the run gathers Θ⁰ from its ranks one fragment at a
time (``group_entry.gather_whole``): every rank holds one fragment whole while it is
uploaded. Runs in the task entering the node, before any of its tasks starts."""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from gradientmail._node.group_entry import follow, gather_whole, lead, refuse
from gradientmail._node.group_link import GroupLink
from gradientmail._node.group_member import GroupMember, Params, fragment_params
from gradientmail._node.lease import Emit
from gradientmail._node.run_creation import Whole, load_newest, open_run
from gradientmail._node.runtime import Runtime
from gradientmail._node.sharded import Layout
from gradientmail._node.spec import NodeSpec
from gradientmail.errors import CorruptBlob, RunMismatch
from gradientmail.events import Joined
from gradientmail.protocol.group import Decision
from gradientmail.protocol.learner import Learner
from gradientmail.protocol.records import Manifest
from gradientmail.reader import RunReader
from gradientmail.store import Store

__all__ = ["Entered", "enter"]


@dataclass(frozen=True, slots=True)
class Entered:
    """What a node starts from: its runtime, its learner (None: a syncer-only node or a
    group's follower), the live parameters of each fragment, its part in a group."""

    rt: Runtime
    start: Learner | None
    params: tuple[tuple[Tensor, ...], ...]
    member: GroupMember | None = None


async def enter(spec: NodeSpec, store: Store, emit: Emit) -> Entered:
    """Create or join the run of ``spec`` through ``store`` (``Joined``); in a group, the
    leader does so and then brings its followers in (or tells them it could not join), and
    a follower waits for it. Raises what ``open_run`` raises, ``RunMismatch``, and
    ``GroupFailed``."""
    link = spec.link
    if link is not None and not link.leader:
        return await _follow(spec, link, store, emit)
    try:
        manifest = await open_run(
            store,
            spec.learner,
            spec.named,
            spec.config,
            spec.options,
            spec.clock,
            emit,
            _whole(spec),
        )
        entered = await _join(spec, store, manifest, emit)
    except Exception as exc:
        if link is not None:
            await refuse(link, exc)
        raise
    if link is None:
        return entered
    start = entered.start
    assert start is not None
    member = GroupMember(link, entered.params, Decision.of(start))
    await lead(link, manifest, spec.learner, member, share=spec.layout is None)
    return replace(entered, member=member)


async def _follow(spec: NodeSpec, link: GroupLink, store: Store, emit: Emit) -> Entered:
    """A follower's entry: the leader's manifest and weights, or in a sharded group this
    rank's rows of the leader's versions, read through its own store."""
    named, layout = spec.named, spec.layout
    assert named is not None
    if layout is None:
        manifest, member = await follow(link, spec.learner, named)
        return Entered(spec.runtime(store, manifest, emit), None, (), member)
    started: list[Learner] = []

    async def load(manifest: Manifest, versions: tuple[int, ...], round: int) -> Params:
        # Read through this rank's own store: checked with its own key, and it learns the
        # run (a signed run's id) it then reads records of.
        if await store.manifest() != manifest:
            raise RunMismatch(
                f"rank {link.rank} finds another run in its mailbox than its leader's: "
                "every rank of a group passes the same mailbox and run key"
            )
        params = layout.params(manifest)
        thetas = await _rows_of(store, manifest, layout, versions)
        _copy(params, thetas)
        started.append(Learner.start(manifest.config, spec.learner, versions, thetas, round))
        return params

    manifest, member = await follow(link, spec.learner, named, load)
    return Entered(spec.runtime(store, manifest, emit), started[0], member.params, member)


def _whole(spec: NodeSpec) -> Whole | None:
    """How a sharded group's leader reads parameters whole to create the run: gathered
    from its ranks (``group_entry.gather_whole``); None when its parameters are its own."""
    link, named = spec.link, spec.named
    if spec.layout is None or link is None or named is None:
        return None

    async def whole(names: Sequence[str]) -> list[Tensor]:
        return await gather_whole(link, named, list(names))

    return whole


async def _join(spec: NodeSpec, store: Store, manifest: Manifest, emit: Emit) -> Entered:
    layout, named = spec.layout, spec.named
    rt = spec.runtime(store, manifest, emit)
    count = manifest.config.fragments
    if named is None:
        # No model to load: its syncer reads each fragment's θ when it first closes a round
        # of it (``commit.load_fragment``); reading them here too would download them twice.
        rounds = await store.record_rounds()
        emit(Joined(spec.learner, manifest.created_by, count, rounds[-1] if rounds else -1))
        return Entered(rt, None, ())
    rows = None if layout is None else layout.fragment_rows(manifest)
    newest = await load_newest(store, manifest, spec.clock, spec.options.poll_interval, rows)
    params = fragment_params(manifest, named) if layout is None else layout.params(manifest)
    _copy(params, newest.thetas)
    start = Learner.start(
        manifest.config, spec.learner, newest.versions, newest.thetas, newest.round
    )
    emit(Joined(spec.learner, manifest.created_by, count, newest.round))
    return Entered(rt, start, params)


def _copy(params: Params, thetas: Params) -> None:
    with torch.no_grad():
        for group, values in zip(params, thetas, strict=True):
            for param, theta in zip(group, values, strict=True):
                param.copy_(theta)


async def _rows_of(
    store: Store, manifest: Manifest, layout: Layout, versions: tuple[int, ...]
) -> Params:
    """This rank's rows of each fragment at ``versions`` (the leader's), read by ranges.
    Raises ``CorruptBlob`` when a blob they need is gone (collected since the leader read
    it: the group's entry fails, and a restart reads newer versions)."""
    rows = layout.fragment_rows(manifest)
    rebuilt = await RunReader(store).rebuild_all(manifest, versions, rows)
    if rebuilt is None:
        raise CorruptBlob(
            f"a blob of versions {list(versions)} was collected before this rank read it: "
            "restart the group"
        )
    return tuple(r.theta for r in rebuilt)
