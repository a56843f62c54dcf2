"""What every task of one node shares: who it is, the run, the store, the clock, the events.

A ``Runtime`` is built once the node has joined its run and never changes; tasks receive it
instead of reaching into the node. ``backoff`` is the retry schedule the tasks share.
"""

from collections.abc import Callable
from dataclasses import dataclass

from gradientmail._node.options import NodeOptions
from gradientmail.clock import Clock
from gradientmail.events import Event
from gradientmail.protocol.records import FragmentSpec, Manifest, RunConfig
from gradientmail.store import Store

__all__ = ["Runtime", "backoff"]


@dataclass(frozen=True, slots=True)
class Runtime:
    learner: str
    store: Store
    manifest: Manifest
    options: NodeOptions
    clock: Clock
    emit: Callable[[Event], None]

    @property
    def config(self) -> RunConfig:
        return self.manifest.config

    @property
    def specs(self) -> tuple[FragmentSpec, ...]:
        return self.manifest.fragments


def backoff(previous: float | None, options: NodeOptions) -> float:
    """The next retry delay after ``previous`` (None: the first failure): from the poll
    interval, doubling, up to ``max_retry_delay``."""
    if previous is None:
        return min(max(options.poll_interval, 0.05), options.max_retry_delay)
    return min(previous * 2, options.max_retry_delay)
