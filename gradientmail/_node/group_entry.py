"""A learner group's entry (``_node.group_member``): the leader, once it has joined the run, sends
its manifest and decision (``lead``) or why it could not join (``refuse``); a follower
checks its model against them and takes the leader's parameters or loads its own rows
(``follow``); a sharded leader creating the run gathers each fragment whole from its ranks
(``gather_whole``). Each collective runs in a worker thread."""

import logging
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread
from torch import Tensor

from gradientmail._node.group_link import GroupLink
from gradientmail._node.group_member import GroupMember, Params, fragment_params
from gradientmail.errors import GroupFailed, RunMismatch
from gradientmail.protocol.group import Decision, Message
from gradientmail.protocol.records import Manifest, decode, encode
from gradientmail.reader import check_model

__all__ = ["Load", "follow", "gather_whole", "lead", "refuse"]

_log = logging.getLogger("gradientmail.group")


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
