"""Coordination patterns over the mailbox alone: a rendezvous and a coordinator-free work queue.

``Barrier`` holds nodes at a named point until enough have arrived; ``shared_queue`` splits a
mapping of units among nodes with create-once claims and prefetches their loaded items. Both
are natively async (anyio) and run under asyncio and trio. See ``docs/patterns.md``.
"""

from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.shared_queue import Loaded, SharedQueue, shared_queue

__all__ = ["Barrier", "Loaded", "SharedQueue", "shared_queue"]
