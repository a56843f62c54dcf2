"""Leases: each node's beats, create-once keys under its name (``keys.lease``).

A beat counts only when its body is a beat of the node it is filed under and, in a signed
run, verifies under the run key and the run's id: a beat someone else planted under a
node's lease is ignored. Beats are create-once, so each verdict is remembered while its key
is listed.

Runs in the node's tasks on the event loop, like the store.
"""

from collections.abc import Sequence

from gradientmail.errors import RecordError
from gradientmail.protocol import keys
from gradientmail.protocol.records import LeaseBeat
from gradientmail.store._objects import RunObjects

__all__ = ["Leases"]

_RELISTS = 3
"""How many times one node's beats are listed in one look at the leases."""


class Leases:
    """The lease beats of the run in ``objects``."""

    def __init__(self, objects: RunObjects) -> None:
        self._objects = objects
        self._beats: dict[str, bool] = {}

    async def beat(self, learner: str, beat: int, role: keys.Role) -> bool:
        """Write beat ``beat`` of ``learner``'s lease, as ``role``; whether it is ours."""
        key = keys.lease(learner, beat, role)
        data = self._objects.encode(key, LeaseBeat(learner=learner))
        return await self._objects.requests.create(key, data)

    async def own_beats(
        self, learner: str, *, attempts: int | None = None
    ) -> list[tuple[int, str]]:
        """The beats of ``learner``'s lease present, as ``(beat, key)``, oldest first: those
        whose body is a beat of ``learner`` (and, in a signed run, verifies), so that beats
        planted under its name neither make it look dead nor push its next beat out of the
        layout."""
        listed = await self._objects.requests.list_keys(
            keys.lease_prefix(learner), attempts=attempts
        )
        return sorted(
            (beat, key) for beat, _, key in await self._node_beats(learner, listed, attempts)
        )

    async def leases(self) -> dict[str, tuple[int, keys.Role]]:
        """Every node holding a lease, with its newest good beat (one whose body is a beat
        of that node and, in a signed run, verifies) and that beat's role."""
        return {
            node: (newest := max(found), found[newest])
            for node, found in (await self.lease_beats()).items()
        }

    async def lease_beats(self) -> dict[str, dict[int, keys.Role]]:
        """Every node's lease beats present, as ``{beat: role}``: only beats whose body is a
        beat of their node and, in a signed run, verifies under the run key and the run's id
        (each beat is read once and remembered), so a beat someone else planted under a
        node's lease is ignored. A node whose beats are all gone by the time they are read
        is absent."""
        await self._objects.refresh_identities()
        listed = await self._objects.requests.list_keys(keys.LEASES)
        by_node: dict[str, list[str]] = {}
        for key in listed:
            parsed = keys.parse_lease(key)
            if parsed is not None:
                by_node.setdefault(parsed[0], []).append(key)
        found: dict[str, dict[int, keys.Role]] = {}
        present = set(listed)
        for node, node_keys in by_node.items():
            beats = await self._node_beats(node, node_keys, None)
            if beats:
                found[node] = {beat: role for beat, role, _ in beats}
            present.update(key for _, _, key in beats)
        self._beats = {key: ok for key, ok in self._beats.items() if key in present}
        return found

    async def _node_beats(
        self, learner: str, listed: Sequence[str], attempts: int | None
    ) -> list[tuple[int, keys.Role, str]]:
        """The good beats of ``learner`` among the keys ``listed``, as ``(beat, role, key)``.

        A node writes its next beat before it deletes the one before, so a beat listed but
        gone when read means a newer one is there: ``learner``'s beats are listed again (at
        most ``_RELISTS`` times) rather than the node looking, for one listing, as if it
        held no lease."""
        for relist in range(_RELISTS + 1):
            if relist:
                listed = await self._objects.requests.list_keys(
                    keys.lease_prefix(learner), attempts=attempts
                )
            found, vanished = await self._verified(learner, listed, attempts)
            if not vanished:
                break
        return found

    async def _verified(
        self, learner: str, listed: Sequence[str], attempts: int | None
    ) -> tuple[list[tuple[int, keys.Role, str]], bool]:
        """The good beats of ``learner`` among ``listed``, and whether any was gone."""
        found: list[tuple[int, keys.Role, str]] = []
        vanished = False
        for key in listed:
            parsed = keys.parse_lease(key)
            if parsed is None or parsed[0] != learner:
                continue
            verdict = await self._beat_ok(key, learner, attempts)
            vanished = vanished or verdict is None
            if verdict:
                found.append((parsed[1], parsed[2], key))
        return found, vanished

    async def _beat_ok(self, key: str, learner: str, attempts: int | None) -> bool | None:
        """Whether ``key`` holds a beat of ``learner`` (verified in a signed run), or None
        when it is gone; each verdict is remembered, as beats are create-once."""
        known = self._beats.get(key)
        if known is not None:
            return known
        data = await self._objects.read(key, attempts=attempts)
        if data is None:
            return None
        try:
            ok = self._objects.decode(key, data, LeaseBeat).learner == learner
        except RecordError as exc:
            self._objects.ignore(key, str(exc))
            ok = False
        self._beats[key] = ok
        return ok
