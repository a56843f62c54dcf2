"""Creating a run, or joining the one in the store.

``open_run`` returns the run's manifest and the newest committed θ of every fragment:

- No manifest: take ``create/0000`` (``CreateClaim``). Only the claims numbered contiguously
  from 0 count (``protocol.rounds.counted``): one planted after a gap is ignored. The holder
  uploads Θ⁰, this model's current weights, fragment by fragment (the blob, then its
  ``init`` marker), then writes the manifest (``CreatingRun``). Everyone else waits
  (``AwaitingCreator``); when no init marker lands for ``creation_timeout`` seconds on the
  waiter's clock, it takes the next claim and creates (``TookOverCreation``). The manifest
  is create-once, so a race between creators is settled there: the loser joins the winner's
  run.
- Joining: a given config must equal the manifest's; the model's signature must match the
  manifest's (``RunMismatch`` naming the first difference; nothing is written). The newest
  committed version of every fragment is then read (``load_newest``).

Runs in the task entering the node, before any other task starts. Transient store failures
are retried with backoff; cancellation stops it between requests and writes nothing more.
"""

from collections.abc import Awaitable, Callable, Sequence

import anyio.to_thread
from torch import Tensor

from gradientmail._node.lease import Emit
from gradientmail._node.options import NodeOptions
from gradientmail.clock import Clock
from gradientmail.errors import RunMismatch
from gradientmail.events.kinds import AwaitingCreator, CreatingRun, TookOverCreation
from gradientmail.protocol.codec import Rows, encode_fragment
from gradientmail.protocol.fragments import signature, window
from gradientmail.protocol.identities import listed
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    InitMarker,
    Manifest,
    RunConfig,
)
from gradientmail.protocol.rounds import MAX_CLAIMS, counted
from gradientmail.reader import Newest, RunReader, check_model
from gradientmail.store import Store

__all__ = ["Newest", "check_config", "load_newest", "open_run"]

NamedParams = Sequence[tuple[str, Tensor]]
Whole = Callable[[Sequence[str]], Awaitable[list[Tensor]]]
"""The whole tensors of the named parameters (a sharded learner group's leader gathers
them from its ranks, one fragment at a time)."""


def check_config(run: RunConfig, ours: RunConfig | None) -> None:
    """Raise ``RunMismatch`` naming the first field where ``ours`` differs from the run's."""
    if ours is None or ours == run:
        return
    for name in run.__struct_fields__:
        theirs, mine = getattr(run, name), getattr(ours, name)
        if theirs != mine:
            raise RunMismatch(
                f"config field {name!r}: the run has {theirs!r}, this node passed {mine!r}; "
                "pass config=None to take the run's config, or start a new run"
            )


def _check_model(manifest: Manifest, named: NamedParams | None) -> None:
    if named is not None:
        check_model(manifest, named)


async def open_run(
    store: Store,
    learner: str,
    named: NamedParams | None,
    config: RunConfig | None,
    options: NodeOptions,
    clock: Clock,
    emit: Emit,
    whole: Whole | None = None,
) -> Manifest:
    """The run's manifest, after creating the run if there is none (see the module docstring).

    A syncer-only node (``named`` None) cannot create a run: it waits for a learner to.
    ``whole``: how to read a fragment's parameters whole, when ``named``'s are shards.
    Raises ``RunMismatch`` when the model or the config contradict the run.
    """
    watching: tuple[int, str] | None = None
    progress = (-1, 0.0)
    while True:
        manifest = await store.manifest()
        if manifest is not None:
            check_config(manifest.config, config)
            _check_model(manifest, named)
            await _check_member(store, learner)
            return manifest
        claims = counted(tuple(await store.create_claims()))
        now = clock.now()
        attempt: int | None = None
        if not claims and named is not None:
            if await store.claim_creation(0, learner):
                attempt = 0
        elif claims:
            last, claimant = claims[-1]
            if claimant == learner and named is not None:
                attempt = last
            else:
                if watching != (last, claimant):
                    watching = (last, claimant)
                    progress = (-1, now)
                    emit(AwaitingCreator(learner, tuple(c for _, c in claims)))
                markers = len(await store.init_markers(last))
                # A claim that names nobody (malformed, or unverified in a signed run) has no
                # creator to wait for.
                if markers != progress[0] and claimant:
                    progress = (markers, now)
                elif named is not None and (
                    not claimant or now - progress[1] >= options.creation_timeout
                ):
                    attempt = await _take_over(store, learner, last)
                    if attempt is not None:
                        emit(TookOverCreation(learner, now - progress[1]))
        if attempt is not None and named is not None:
            manifest = await _create(
                store, learner, named, config or RunConfig(), attempt, emit, whole
            )
            check_config(manifest.config, config)
            _check_model(manifest, named)
            await _check_member(store, learner)
            return manifest
        await clock.sleep(options.poll_interval)


async def _check_member(store: Store, learner: str) -> None:
    """``RunMismatch`` unless this node's learner key may speak for ``learner`` (in a run
    with learner identities)."""
    await store.refresh_identities()
    store.signing.check_member(learner)


async def _take_over(store: Store, learner: str, last: int) -> int | None:
    """The attempt this node creates the run as after claim ``last`` failed, or None when
    another node took the next claim first. When every claim number is taken (only a
    hostile writer takes them all) it creates without a claim: the manifest is create-once,
    so racing creators still make one run."""
    if last + 1 >= MAX_CLAIMS:
        return last
    return last + 1 if await store.claim_creation(last + 1, learner) else None


async def _create(
    store: Store,
    learner: str,
    named: NamedParams,
    config: RunConfig,
    attempt: int,
    emit: Emit,
    whole: Whole | None,
) -> Manifest:
    specs = signature(named, config.fragments, config.pattern)
    by_name = dict(named)
    emit(CreatingRun(learner, config.fragments, config.pattern, tuple(s.numel for s in specs)))
    theta0: list[BlobRef] = []
    for spec in specs:
        names = [param.name for param in spec.params]
        wholes = [by_name[name] for name in names] if whole is None else await whole(names)
        tensors = [window(t, param) for t, param in zip(wholes, spec.params, strict=True)]
        data = await anyio.to_thread.run_sync(_encode_fp32, tensors, spec)
        ref = await store.put_blob(data, "fp32", indexed=True)
        await store.put_init_marker(
            attempt, InitMarker(learner=learner, fragment=spec.index, blob=ref)
        )
        theta0.append(ref)
    ours = listed(
        Manifest(created_by=learner, config=config, fragments=specs, theta0=tuple(theta0)),
        store.signing.learner_key,
    )
    return await store.create_manifest(ours)


def _encode_fp32(tensors: Sequence[Tensor], spec: FragmentSpec) -> bytes:
    return encode_fragment(tensors, spec, "fp32", block_size=1)


async def load_newest(
    store: Store,
    manifest: Manifest,
    clock: Clock,
    poll: float,
    rows: Sequence[Rows] | None = None,
) -> Newest:
    """Read the newest committed θ of every fragment (with ``rows``: those rows of each,
    a sharded rank's) through the one read path (``gradientmail.reader``): junk skipped,
    signatures checked with the store's key.

    A θ blob collected between the listing and the read means newer records exist: the
    listing is taken again every ``poll`` seconds while newer records appear. Raises
    ``CorruptBlob`` when a blob the newest records name is gone and 5 listings in a row
    (``poll`` apart) show no newer record, ``RecordError`` / ``CorruptBlob`` for damaged
    objects.
    """
    return await RunReader(store).newest(manifest, clock=clock, poll=poll, rows=rows)
