"""Creating a run, or joining the one in the store.

``open_run`` returns the run's manifest and the newest committed θ of every fragment:

- No manifest: take ``create/0000`` (``CreateClaim``). Only the claims numbered contiguously
  from 0 count (``protocol.rounds.counted_claims``): one planted after a gap is ignored. The holder
  uploads Θ⁰, this model's current weights, fragment by fragment (the blob, then its
  ``init`` marker), then writes the manifest (``CreatingRun``). Everyone else waits
  (``AwaitingCreator``); when no init marker lands for ``creation_timeout`` seconds on the
  waiter's clock, it takes the next claim and creates (``TookOverCreation``). The manifest
  is create-once, so a race between creators is settled there: the loser joins the winner's
  run.
- Joining: a given config must equal the manifest's; the model's signature must match the
  manifest's (``RunMismatch`` naming the first difference; nothing is written). The newest
  committed version of every fragment is then read (``load_newest``).

What to do next while there is no manifest is ``protocol.creation.decide_creation``'s
decision; this module only lists, claims, uploads and sleeps as it says.

Runs in the task entering the node, before any other task starts. Transient store failures
are retried with backoff; cancellation stops it between requests and writes nothing more.
"""

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import anyio.to_thread
from torch import Tensor

from gradientmail._node.lease import Emit
from gradientmail._node.options import NodeOptions
from gradientmail.clock import Clock
from gradientmail.errors import RunMismatch
from gradientmail.events.kinds import AwaitingCreator, CreatingRun, TookOverCreation
from gradientmail.protocol.codec import encode_fragment
from gradientmail.protocol.creation import (
    ClaimCreation,
    Count,
    Create,
    CreationAction,
    CreationState,
    CreationView,
    TakeOverCreation,
    decide_creation,
)
from gradientmail.protocol.fragments import signature, window
from gradientmail.protocol.identities import listed
from gradientmail.protocol.layout import Rows
from gradientmail.protocol.records import (
    BlobRef,
    FragmentSpec,
    InitMarker,
    Manifest,
    RunConfig,
)
from gradientmail.reader import Newest, RunReader, check_model
from gradientmail.store import Store

__all__ = ["Newest", "check_config", "load_newest", "open_run"]

NamedParams = Sequence[tuple[str, Tensor]]
Whole = Callable[[Sequence[str]], Awaitable[list[Tensor]]]
"""The whole tensors of the named parameters (a sharded learner group's leader gathers
them from its ranks, one fragment at a time)."""


def check_config(run: RunConfig, ours: RunConfig | None) -> None:
    """Raise ``RunMismatch`` naming the first field where ``ours`` differs from the run's
    (``checkpoint_every`` by the interval it gives, so that an unset one matches its
    default's number)."""
    if ours is None:
        return
    run, ours = run.resolved(), ours.resolved()
    if ours == run:
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
    state = CreationState(learner, named is not None, options.creation_timeout)
    while True:
        manifest = await store.manifest()
        if manifest is None:
            view = CreationView(tuple(await store.create_claims()))
            now = clock.now()
            state, action = decide_creation(state, view, now)
            if isinstance(action, Count):
                if action.announce is not None:
                    emit(AwaitingCreator(learner, action.announce))
                view = replace(view, markers=len(await store.init_markers(action.k)))
                state, action = decide_creation(state, view, now)
            attempt = await _attempt(store, learner, action, emit)
            if attempt is None or named is None:
                await clock.sleep(options.poll_interval)
                continue
            ours = config or RunConfig()
            manifest = await _create(store, learner, named, ours, options, attempt, emit, whole)
        check_config(manifest.config, config)
        _check_model(manifest, named)
        await _check_member(store, learner, options.admission_key)
        return manifest


async def _attempt(store: Store, learner: str, action: CreationAction, emit: Emit) -> int | None:
    """The attempt this node creates the run as after ``action``, once its claim is won;
    None when there is nothing to create now (waiting, or another node won the claim)."""
    match action:
        case ClaimCreation(k):
            return k if await store.claim_creation(k, learner) else None
        case Create(attempt):
            return attempt
        case TakeOverCreation(k, waited, claim):
            if claim and not await store.claim_creation(k, learner):
                return None
            emit(TookOverCreation(learner, waited))
            return k
        case _:
            return None


async def _check_member(store: Store, learner: str, admission_key: str | None) -> None:
    """``RunMismatch`` unless this node's learner key may speak for ``learner`` (in a run
    with learner identities, whose manifest names ``admission_key``)."""
    await store.refresh_identities()
    store.signing.check_member(learner, admission_key)


async def _create(
    store: Store,
    learner: str,
    named: NamedParams,
    config: RunConfig,
    options: NodeOptions,
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
        options.learner_key,
        options.admission_key,
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
