"""A fragment's committed version rebuilt from the store: the newest checkpoint at or below
it (Θ⁰ for version 0), then every round after it replayed (``protocol.checkpoint``: bit for
bit what the syncer committed); or some rows of it, each blob read by ranges.

``RunReader`` is the way in (``rebuild``, ``rebuild_rows``, ``rows``, ``rebuild_all``, whose
docstrings state the contract); this module holds how it is done. Reads go through the
reader's store and its record cache; decoding and replay go to a worker thread.
"""

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import anyio
import anyio.to_thread
from torch import Tensor

from gradientmail._concurrent import gather
from gradientmail.errors import CorruptBlob, RecordError
from gradientmail.protocol import checkpoint, keys
from gradientmail.protocol.codec import (
    HEAD_BYTES,
    Rows,
    blob_layout,
    decode_fragment,
    decode_rows,
    open_delta,
    row_spans,
    rows_of,
    tensors_of,
)
from gradientmail.protocol.outer import added
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    Manifest,
    RoundRecord,
    RunConfig,
    Snapshot,
)
from gradientmail.protocol.sizes import delta_problem, max_blob_bytes
from gradientmail.protocol.sparse import TOPK
from gradientmail.store import Store

__all__ = ["Need", "Rebuilder", "Rebuilt"]

Need = Callable[[int, Manifest], Awaitable[RoundRecord]]
"""The record of a round of ``manifest``'s run that a rebuild needs; ``RecordError`` when it
is missing (``RunReader``'s, cached)."""

_CONCURRENT_REBUILDS = 2
"""Fragments ``rebuild_all`` rebuilds at once: a joiner of a 1 GiB model (four fragments,
each a checkpoint and five int8 updates) took 9.5 s from a directory rebuilding one at a time
and 4.4 s two at a time, on two cores (``benchmarks/bench_rejoin.py``); each one in flight
holds a fragment's transient copies (θ, the next θ, a blob), so more would cost memory."""


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """Version ``version`` of a fragment: its θ (fp32, CPU, in spec order) and, when rebuilt
    with its outer state (``outer`` True), the outer momentum after it (``momentum`` None at
    a version no outer step has reached yet, and always in a run whose outer step keeps no
    state: ``checkpoint.stateful``)."""

    version: int
    theta: tuple[Tensor, ...]
    momentum: tuple[Tensor, ...] | None = None
    outer: bool = False


class Rebuilder:
    """Rebuilds versions of the run in ``store``, taking each record from ``need``."""

    def __init__(self, store: Store, need: Need) -> None:
        self._store = store
        self._need = need

    async def rebuild_all(
        self, manifest: Manifest, versions: Sequence[int], rows: Sequence[Rows] | None
    ) -> list[Rebuilt] | None:
        """``RunReader.rebuild_all``: ``_CONCURRENT_REBUILDS`` fragments at a time."""
        limiter = anyio.CapacityLimiter(_CONCURRENT_REBUILDS)

        async def one(fragment: int) -> Rebuilt | None:
            async with limiter:
                if rows is not None:
                    return await self.rebuild_rows(
                        manifest, fragment, versions[fragment], rows[fragment]
                    )
                return await self.rebuild(manifest, fragment, versions[fragment])

        rebuilt = await gather([partial(one, fragment) for fragment in range(len(versions))])
        found = [r for r in rebuilt if r is not None]
        return found if len(found) == len(versions) else None

    async def rebuild(
        self,
        manifest: Manifest,
        fragment: int,
        version: int,
        *,
        momentum: bool = False,
        start: Rebuilt | None = None,
    ) -> Rebuilt | None:
        """``RunReader.rebuild`` in ``manifest``'s run."""
        config, spec = manifest.config, manifest.fragments[fragment]
        # A run whose outer step keeps no state has no momentum to replay.
        replay = momentum and checkpoint.stateful(config)
        begin = start
        if begin is None or not (
            checkpoint.base(version, config) <= begin.version <= version
            and (begin.outer or not replay)
        ):
            begin = await self._checkpoint(manifest, fragment, version, replay)
        if begin is None:
            return None
        theta, moment = begin.theta, begin.momentum
        for later in range(begin.version + 1, version + 1):
            record = await self._need(keys.round_of(fragment, later, config.fragments), manifest)
            update = await self._store.get_blob(record.update, most=max_blob_bytes(spec))
            if update is None:
                return None
            mean = await self._mean(record, spec, config) if replay else None
            theta_list, moment_list = await anyio.to_thread.run_sync(
                partial(checkpoint.replayed, theta, moment, update, spec, config, mean=mean)
            )
            theta = tuple(theta_list)
            moment = None if moment_list is None else tuple(moment_list)
        return Rebuilt(version, theta, moment if replay else None, outer=momentum)

    async def rows(self, ref: BlobRef, spec: FragmentSpec, rows: Rows) -> list[Tensor] | None:
        """``RunReader.rows``: a ``topk`` blob whole, any other by ranges (its header, then
        the bytes of ``rows``)."""
        if ref.encoding == TOPK:
            data = await self._store.get_blob(ref)
            if data is None:
                return None
            return await anyio.to_thread.run_sync(rows_of, data, spec, rows)
        head = await self._store.blob_ranges(ref, [(0, min(ref.size, HEAD_BYTES))])
        if head is None:
            return None
        layout = blob_layout(head[0], ref.size, spec)
        fetched = await self._store.blob_ranges(ref, row_spans(layout, rows))
        if fetched is None:
            return None
        return await anyio.to_thread.run_sync(decode_rows, layout, rows, fetched)

    async def rebuild_rows(
        self, manifest: Manifest, fragment: int, version: int, rows: Rows
    ) -> Rebuilt | None:
        """``RunReader.rebuild_rows`` in ``manifest``'s run."""
        config, spec = manifest.config, manifest.fragments[fragment]
        at = await self._checkpoint_at(manifest, fragment, version)
        ref = manifest.theta0[fragment] if at[1] is None else at[1].theta
        assert ref is not None
        theta = await self.rows(ref, spec, rows)
        if theta is None:
            return None
        for later in range(at[0] + 1, version + 1):
            record = await self._need(keys.round_of(fragment, later, config.fragments), manifest)
            update = await self.rows(record.update, spec, rows)
            if update is None:
                return None
            theta = added(theta, update)
        return Rebuilt(version, tuple(theta), None, outer=False)

    async def _checkpoint_at(
        self, manifest: Manifest, fragment: int, version: int
    ) -> tuple[int, RoundRecord | None]:
        """The version of the newest checkpoint at or below ``version`` and its record
        (None: Θ⁰): the newest record down to the one ``checkpoint.base`` guarantees that
        carries one (runs created before the rule carry one on every record), else Θ⁰."""
        config = manifest.config
        at, record = checkpoint.base(version, config), None
        for candidate in range(version, at, -1):
            found = await self._need(keys.round_of(fragment, candidate, config.fragments), manifest)
            if found.checkpoint:
                return candidate, found
        if at > 0:
            record = await self._need(keys.round_of(fragment, at, config.fragments), manifest)
        return at, record

    async def _checkpoint(
        self, manifest: Manifest, fragment: int, version: int, momentum: bool
    ) -> Rebuilt | None:
        """The newest checkpoint at or below ``version``: the newest record down to the one
        ``checkpoint.base`` guarantees that carries one (runs created before the rule carry
        one on every record), else Θ⁰; None when a blob is gone."""
        spec = manifest.fragments[fragment]
        at, record = await self._checkpoint_at(manifest, fragment, version)
        refs = [manifest.theta0[fragment]] if record is None else [record.theta, record.outer]
        if not momentum:
            refs = refs[:1]
        tensors = []
        for ref in refs:
            assert ref is not None
            data = await self._store.get_blob(ref, most=max_blob_bytes(spec))
            if data is None:
                return None
            tensors.append(tuple(await anyio.to_thread.run_sync(decode_fragment, data, spec)))
        moment = tensors[1] if len(tensors) > 1 else None
        return Rebuilt(at, tensors[0], moment, outer=momentum)

    async def _mean(
        self, record: RoundRecord, spec: FragmentSpec, config: RunConfig
    ) -> tuple[list[Tensor] | None, bool]:
        """``checkpoint.mean_of`` ``record``'s round, from its participants' deltas."""
        wanted = {p.learner for p in record.participants}
        found = []
        for snapshot, problem in await self._store.snapshots(record.round):
            if snapshot.learner not in wanted or problem is not None:
                continue
            if (oversized := delta_problem(snapshot, spec)) is not None:
                raise CorruptBlob(
                    f"the delta of {snapshot.learner!r} in round {record.round}: {oversized}"
                )
            datas = await self._store.delta_blobs(snapshot)
            if datas is None:
                raise RecordError(
                    f"the delta of {snapshot.learner!r} in round {record.round}, which the "
                    "record counts, is gone: its momentum cannot be replayed"
                )
            delta = await anyio.to_thread.run_sync(_decoded_delta, datas, snapshot, spec)
            found.append((snapshot, delta))
        return checkpoint.mean_of(record, found, spec, config)


def _decoded_delta(datas: Sequence[bytes], snapshot: Snapshot, spec: FragmentSpec) -> list[Tensor]:
    return tensors_of(open_delta(datas, snapshot, spec))
