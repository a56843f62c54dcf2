"""Each learner its own deterministic shard of a data set, and a warning when two live learners
declare the same one.

``shard_of`` is pure: from a learner id and the run's learner list (or a declared count) it
gives a ``Shard``, which cuts an index range or a sequence into contiguous, balanced parts.
``declare`` records the shard in the store and warns (``ShardOverlap``) when another learner
that holds a live lease declared the same shard, or the same data set cut differently.
"""

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from gradientmail.mailbox import Mailbox, check_key
from gradientmail.protocol.keys import check_learner, trains
from gradientmail.store import Store

__all__ = ["SHARDS", "Shard", "ShardOverlap", "declare", "shard_of"]

SHARDS = "shards/"
"""Where declarations live: ``shards/{name}/{count}/{index}/{learner}``, empty, create-once."""

T = TypeVar("T")

_TRAILING_NUMBER = re.compile(r"(\d+)$")


class ShardOverlap(UserWarning):
    """Two live learners train on overlapping data: the same shard, or one data set cut into
    different counts."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Part ``index`` of ``count`` (0-based): the contiguous block of rows
    ``[length * index // count, length * (index + 1) // count)``. Blocks differ in size by at
    most one and together cover every row once."""

    index: int
    count: int

    def __post_init__(self) -> None:
        for name, value in (("index", self.index), ("count", self.count)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Shard.{name} must be an int, got {value!r}")
        if self.count < 1:
            raise ValueError(f"Shard.count must be at least 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"Shard.index must be in [0, {self.count}), got {self.index}")

    def indices(self, length: int) -> range:
        """This shard's rows of a data set of ``length`` rows."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be a non-negative int, got {length!r}")
        return range(length * self.index // self.count, length * (self.index + 1) // self.count)

    def take(self, rows: Sequence[T]) -> Sequence[T]:
        """This shard's part of ``rows`` (a list, a tensor, anything sliceable with a len)."""
        part = self.indices(len(rows))
        return rows[part.start : part.stop]


def shard_of(
    learner: str, *, learners: Sequence[str] | None = None, count: int | None = None
) -> Shard:
    """The shard of ``learner``: with ``learners`` (the run's learner ids, in any order), its
    place in their sorted order, of ``len(learners)``; with ``count``, the number that ends
    its id (``host-3`` is shard 3), of ``count``. Give exactly one of the two. Deterministic:
    every learner computes every other's shard alike.

    Raises ``ValueError`` naming the problem: neither or both given, ``learner`` not in
    ``learners`` or listed twice, an id that does not end in a number below ``count``.
    """
    check_learner(learner)
    if (learners is None) == (count is None):
        raise ValueError("give exactly one of learners= (the run's learner ids) or count=")
    if learners is not None:
        if isinstance(learners, str):
            raise TypeError("learners must be a sequence of learner ids, not one string")
        ordered = sorted(learners)
        if len(set(ordered)) != len(ordered):
            raise ValueError(f"learners lists an id twice: {ordered}")
        if learner not in ordered:
            raise ValueError(f"learner {learner!r} is not among the learners {ordered}")
        return Shard(ordered.index(learner), len(ordered))
    assert count is not None
    match = _TRAILING_NUMBER.search(learner)
    if match is None:
        raise ValueError(
            f"learner {learner!r} does not end in a number: with count=, name learners "
            "'name-0' to f'name-{count - 1}', or pass learners= instead"
        )
    return Shard(int(match.group(1)), count)


def _prefix(name: str) -> str:
    check_key(name)
    if "/" in name:
        raise ValueError(f"a data set's name is one key segment (no '/'), got {name!r}")
    return f"{SHARDS}{name}/"


async def declare(mailbox: Mailbox, learner: str, shard: Shard, *, name: str = "data") -> Shard:
    """Record that ``learner`` trains on ``shard`` of the data set ``name``, then warn once
    (``warnings.warn`` with ``ShardOverlap``, naming them) when other learners holding a
    live lease declared shards of ``name`` whose rows overlap it: the same shard, or a part
    of a different count that intersects it. Returns ``shard``.

    A learner restarted with the same id finds its own declaration and is not warned about
    itself; declarations of learners whose lease is gone are ignored. Runs in the caller's
    task; ``MailboxUnavailable`` is retried as every store call is, other store errors
    propagate.
    """
    check_learner(learner)
    if not isinstance(shard, Shard):
        raise TypeError(f"shard must be a Shard, got {type(shard).__name__}")
    prefix = _prefix(name)
    store = Store(mailbox)
    await store.create(f"{prefix}{shard.count}/{shard.index}/{learner}", b"")
    live = {who for who, (_, role) in (await store.leases()).items() if trains(role)}
    overlapping = []
    for key in await store.list_keys(prefix):
        parts = key[len(prefix) :].split("/")
        if len(parts) != 3 or parts[2] == learner or parts[2] not in live:
            continue
        if not (parts[0].isdigit() and parts[1].isdigit()):
            continue
        other = Shard(int(parts[1]), int(parts[0]))
        if _overlap(shard, other):
            overlapping.append(f"{parts[2]!r} (shard {other.index} of {other.count})")
    if overlapping:
        warnings.warn(
            ShardOverlap(
                f"data set {name!r}: learner {learner!r} takes shard {shard.index} of "
                f"{shard.count}, whose rows live learners also take: {', '.join(overlapping)}; "
                "give each learner its own index of one count"
            ),
            stacklevel=2,
        )
    return shard


def _overlap(a: Shard, b: Shard) -> bool:
    """Whether the parts ``[a.index/a.count, (a.index+1)/a.count)`` and b's intersect."""
    return (
        a.index * b.count < (b.index + 1) * a.count and b.index * a.count < (a.index + 1) * b.count
    )
