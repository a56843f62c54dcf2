"""Coordination patterns over the mailbox alone: a rendezvous, a coordinator-free work queue,
and fixed data shards.

``Barrier`` holds nodes at a named point until enough have arrived; ``shared_queue`` splits a
mapping of units among nodes with create-once claims and prefetches their loaded items;
``shard_of`` gives each learner a deterministic ``Shard`` and ``declare`` warns when two live
learners declare the same one; ``LocalState`` keeps what a restarted learner needs besides
the weights. All are natively async (anyio) and run under asyncio and
trio. See ``docs/patterns.md``.
"""

from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.resume import LocalState, Resumed
from gradientmail.patterns.shards import Shard, ShardOverlap, declare, shard_of
from gradientmail.patterns.shared_queue import Loaded, SharedQueue, shared_queue

__all__ = [
    "Barrier",
    "Loaded",
    "LocalState",
    "Resumed",
    "Shard",
    "ShardOverlap",
    "SharedQueue",
    "declare",
    "shard_of",
    "shared_queue",
]
