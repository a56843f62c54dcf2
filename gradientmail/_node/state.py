"""``NodeState``: what a node has done so far, as one immutable value."""

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["NodeState"]


@dataclass(frozen=True, slots=True)
class NodeState:
    """A snapshot of one node, taken on the event-loop thread by ``Node.state``.

    round
        The newest round whose record this node has seen (-1: none yet).
    versions
        The version of each fragment the model holds (the last one applied).
    aligned_round
        The newest round whose version the model holds (-1: Θ⁰ only).
    steps, tokens
        Local steps and tokens counted by ``step()`` since this node started.
    rounds_committed
        Rounds whose record this node's syncer wrote, among the records its learner has
        read (a syncer-only node reads none: 0).
    bytes_published, bytes_downloaded
        Bytes this node wrote to and read from the store (every kind of object).
    requests
        Requests this node made to the store, by kind (put, get, list, delete), retries
        included.
    rank, world
        This process's rank in its learner group and the group's size (0 and 1 without a
        group). In a group, ``round``, ``versions``, ``aligned_round``, ``steps`` and
        ``tokens`` are the learner's as decided at the last ``step()``, the same on every
        rank (on the leader, ``steps`` and ``tokens`` are what its learner counted: after
        a failed ``step()`` one more than the followers'); the store's bytes and requests
        are this rank's own.
    group_bytes_sent, group_bytes_received
        Payload bytes this rank sent to and received from its group's collectives (control
        exchanges, and the fragments the leader broadcast); 0 without a group.
    waited_seconds
        Seconds ``step()`` spent waiting for a round's version at its overlap step
        (``RunConfig.overlap``; always 0 with ``overlap=None``). A share of the training
        time that grows means the rounds take longer than ``overlap`` steps: raise it.
    """

    learner: str
    round: int
    versions: tuple[int, ...]
    aligned_round: int
    steps: int
    tokens: int
    rounds_committed: int
    bytes_published: int
    bytes_downloaded: int
    requests: Mapping[str, int] = field(default_factory=dict)
    rank: int = 0
    world: int = 1
    group_bytes_sent: int = 0
    group_bytes_received: int = 0
    waited_seconds: float = 0.0
