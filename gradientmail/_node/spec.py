"""What a node is, checked once: ``node_spec`` turns the keywords of ``gradientmail.node``
(and ``gradientmail.sync.node``/``open``) into a ``NodeSpec`` that entering and running the
node take instead of the keywords one by one.

Building one does no I/O and starts nothing: it may run on any thread (``sync`` builds it on
the caller's, before its event loop starts). Every bad argument raises here, before anything
is opened or written.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradientmail._node.group_link import GroupLink, link_of
from gradientmail._node.lease import Emit
from gradientmail._node.model_parameters import named_parameters, shards
from gradientmail._node.options import NodeOptions
from gradientmail._node.runtime import Runtime
from gradientmail._node.sharded import Layout
from gradientmail.clock import Clock, MonotonicClock
from gradientmail.events import Sink
from gradientmail.mailbox import Mailbox
from gradientmail.protocol import keys
from gradientmail.protocol.records import Manifest, RunConfig
from gradientmail.protocol.signing import RunKey
from gradientmail.store import Store

__all__ = ["Named", "NodeSpec", "node_spec"]

Named = list[tuple[str, Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """One node as its caller described it, checked: who it is (``learner``), where its run
    is (``mailbox``: a ``Mailbox`` the caller keeps open, or a URL the node opens), what it
    trains (``named``: the model's parameters; None for a syncer-only node), the config it
    creates or expects (``config``; None takes the run's), its timings and roles
    (``options``), where its events go (``sinks``), its clock, the run's secret
    (``run_key``), and in a learner group its link to the other ranks (``link``) and, when
    its parameters are sharded, its rows of them (``layout``)."""

    learner: str
    mailbox: Mailbox | str
    named: Named | None
    config: RunConfig | None
    options: NodeOptions
    sinks: Sequence[Sink]
    clock: Clock
    run_key: RunKey | None
    link: GroupLink | None
    layout: Layout | None

    def store(self, mailbox: Mailbox) -> Store:
        """The node's ``Store`` over the opened ``mailbox``: its clock, retries and keys."""
        return Store(
            mailbox,
            clock=self.clock,
            max_retry_delay=self.options.max_retry_delay,
            run_key=self.run_key,
            learner_key=self.options.learner_key,
        )

    def runtime(self, store: Store, manifest: Manifest, emit: Emit) -> Runtime:
        """What the node's tasks share once it has joined the run of ``manifest``."""
        return Runtime(
            learner=self.learner,
            store=store,
            manifest=manifest,
            options=self.options,
            clock=self.clock,
            emit=emit,
        )


def node_spec(
    model: torch.nn.Module | None,
    mailbox: Mailbox | str,
    *,
    learner: str,
    config: RunConfig | None,
    options: NodeOptions | None,
    sinks: Sequence[Sink],
    clock: Clock | None,
    run_key: RunKey | str | bytes | None,
    group: object,
) -> NodeSpec:
    """The ``NodeSpec`` of ``gradientmail.node``'s arguments (its docstring says what each
    is), defaults filled in: ``NodeOptions()``, a monotonic clock, the run key from the
    ``GRADIENTMAIL_RUN_KEY`` environment variable. Raises ``ValueError``/``TypeError``
    naming the argument to fix."""
    keys.check_learner(learner)
    options = options if options is not None else NodeOptions()
    if not isinstance(options, NodeOptions):
        raise TypeError(f"options must be a NodeOptions, got {type(options).__name__}")
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be a RunConfig or None, got {type(config).__name__}")
    link = link_of(group, options.group_timeout, model=model is not None)
    named = named_parameters(model, sharded=link is not None)
    if named is None and not options.syncer:
        raise ValueError("a node without a model must be a syncer (options.syncer=True)")
    layout = _layout(named, link)
    key = _run_key(run_key)
    if options.learner_key is not None and key is None:
        raise ValueError("a node with options.learner_key needs the run key too (run_key=...)")
    return NodeSpec(
        learner=learner,
        mailbox=mailbox,
        named=named,
        config=config,
        options=options,
        sinks=sinks,
        clock=clock if clock is not None else MonotonicClock(),
        run_key=key,
        link=link,
        layout=layout,
    )


def _layout(named: Named | None, link: GroupLink | None) -> Layout | None:
    """This rank's rows of each parameter, when ``named`` holds a sharded group's shards."""
    if link is None or named is None:
        return None
    found = shards(named, link.rank, link.world)
    if found is None:
        return None
    pairs = list(zip(named, found, strict=True))
    return Layout(
        {name: shard.local for (name, _), shard in pairs},
        {name: (shard.start, shard.end) for (name, _), shard in pairs},
    )


def _run_key(run_key: RunKey | str | bytes | None) -> RunKey | None:
    if run_key is None:
        return RunKey.from_env()
    return run_key if isinstance(run_key, RunKey) else RunKey(run_key)
