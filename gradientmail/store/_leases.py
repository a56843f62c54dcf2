"""Leases: each node's beats, create-once keys under its name (``keys.lease``).

A beat counts only when its body is a beat of the node it is filed under and, in a signed
run, verifies under the run key and the run's id: a beat someone else planted under a
node's lease is ignored. Beats are create-once, so each verdict is remembered while its key
is listed.

Runs in the node's tasks on the event loop, like the store.
"""

from gradientmail.errors import RecordError
from gradientmail.protocol import keys
from gradientmail.protocol.records import LeaseBeat
from gradientmail.store._objects import RunObjects

__all__ = ["Leases"]


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
        beats = []
        listed = await self._objects.requests.list_keys(
            keys.lease_prefix(learner), attempts=attempts
        )
        for key in listed:
            parsed = keys.parse_lease(key)
            if parsed is not None and await self._beat_ok(key, learner, attempts):
                beats.append((parsed[1], key))
        return sorted(beats)

    async def leases(self) -> dict[str, tuple[int, keys.Role]]:
        """Every node holding a lease, with its newest good beat (one whose body is a beat
        of that node and, in a signed run, verifies) and that beat's role."""
        await self._objects.refresh_identities()
        listed: dict[str, list[tuple[int, keys.Role, str]]] = {}
        for key in await self._objects.requests.list_keys(keys.LEASES):
            parsed = keys.parse_lease(key)
            if parsed is not None:
                learner, beat, role = parsed
                listed.setdefault(learner, []).append((beat, role, key))
        newest: dict[str, tuple[int, keys.Role]] = {}
        for learner, beats in listed.items():
            for beat, role, key in sorted(beats, reverse=True):
                if await self._beat_ok(key, learner, None):
                    newest[learner] = (beat, role)
                    break
        present = {key for beats in listed.values() for _, _, key in beats}
        self._beats = {key: ok for key, ok in self._beats.items() if key in present}
        return newest

    async def lease_beats(self) -> dict[str, dict[int, keys.Role]]:
        """Every node's lease beats present, as ``{beat: role}``: only beats whose body is a
        beat of their node and, in a signed run, verifies under the run key and the run's id
        (each beat is read once and remembered), so a beat someone else planted under a
        node's lease is ignored."""
        await self._objects.refresh_identities()
        listed = [
            (key, parsed)
            for key in await self._objects.requests.list_keys(keys.LEASES)
            if (parsed := keys.parse_lease(key)) is not None
        ]
        found: dict[str, dict[int, keys.Role]] = {}
        for key, (node, beat, role) in listed:
            if await self._beat_ok(key, node, None):
                found.setdefault(node, {})[beat] = role
        present = {key for key, _ in listed}
        self._beats = {key: ok for key, ok in self._beats.items() if key in present}
        return found

    async def _beat_ok(self, key: str, learner: str, attempts: int | None) -> bool:
        """Whether ``key`` holds a beat of ``learner`` (verified in a signed run); each
        verdict is remembered, as beats are create-once."""
        known = self._beats.get(key)
        if known is not None:
            return known
        data = await self._objects.read(key, attempts=attempts)
        if data is None:
            return False
        try:
            ok = self._objects.decode(key, data, LeaseBeat).learner == learner
        except RecordError as exc:
            self._objects.ignore(key, str(exc))
            ok = False
        self._beats[key] = ok
        return ok
