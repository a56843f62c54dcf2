"""Entering a run: creating or joining it (``_node.creation``), loading the newest committed
weights into the model, and a learner group's entry (``_node.group``: its leader joins and
brings its followers in; the followers take the leader's manifest and weights and never
touch the store). Runs in the task entering the node, before any of its tasks starts."""

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from gradientmail._node.creation import load_newest, open_run
from gradientmail._node.group import GroupLink, GroupMember, follow, fragment_params, lead, refuse
from gradientmail._node.lease import Emit
from gradientmail._node.options import NodeOptions
from gradientmail._node.runtime import Runtime
from gradientmail.clock import Clock
from gradientmail.events import Joined
from gradientmail.protocol.group import Decision
from gradientmail.protocol.learner import Learner
from gradientmail.protocol.records import Manifest, RunConfig
from gradientmail.store import Store

__all__ = ["Entered", "enter"]

Named = list[tuple[str, Tensor]]


@dataclass(frozen=True, slots=True)
class Entered:
    """What a node starts from: its runtime, its learner (None: a syncer-only node or a
    group's follower), the live parameters of each fragment, its part in a group."""

    rt: Runtime
    start: Learner | None
    params: tuple[tuple[Tensor, ...], ...]
    member: GroupMember | None = None


async def enter(
    store: Store,
    learner: str,
    named: Named | None,
    config: RunConfig | None,
    options: NodeOptions,
    clock: Clock,
    emit: Emit,
    link: GroupLink | None,
) -> Entered:
    """Create or join the run (``Joined``); in a group, the leader does so and then brings
    its followers in (or tells them it could not join), and a follower waits for it.
    Raises what ``open_run`` raises, ``RunMismatch``, and ``GroupFailed``."""
    if link is not None and not link.leader:
        assert named is not None
        manifest, member = await follow(link, learner, named)
        return Entered(_runtime(store, manifest, learner, options, clock, emit), None, (), member)
    try:
        manifest = await open_run(store, learner, named, config, options, clock, emit)
        entered = await _join(store, manifest, learner, named, options, clock, emit)
    except Exception as exc:
        if link is not None:
            await refuse(link, exc)
        raise
    if link is None:
        return entered
    start = entered.start
    assert start is not None
    view = Decision(start.versions, start.newest_round, start.aligned_round)
    member = GroupMember(link, entered.params, view)
    await lead(link, manifest, learner, member)
    return replace(entered, member=member)


def _runtime(
    store: Store, manifest: Manifest, learner: str, options: NodeOptions, clock: Clock, emit: Emit
) -> Runtime:
    return Runtime(
        learner=learner, store=store, manifest=manifest, options=options, clock=clock, emit=emit
    )


async def _join(
    store: Store,
    manifest: Manifest,
    learner: str,
    named: Named | None,
    options: NodeOptions,
    clock: Clock,
    emit: Emit,
) -> Entered:
    rt = _runtime(store, manifest, learner, options, clock, emit)
    newest = await load_newest(store, manifest, clock, options.poll_interval)
    start = None
    params: tuple[tuple[Tensor, ...], ...] = ()
    if named is not None:
        params = fragment_params(manifest, named)
        with torch.no_grad():
            for group, thetas in zip(params, newest.thetas, strict=True):
                for param, theta in zip(group, thetas, strict=True):
                    param.copy_(theta)
        start = Learner.start(
            manifest.config, learner, newest.versions, newest.thetas, newest.round
        )
    emit(Joined(learner, manifest.created_by, manifest.config.fragments, newest.round))
    return Entered(rt, start, params)
