"""``gradientmail.events.tensorboard(log_dir)``: a sink writing a node's progress as
TensorBoard scalars through ``torch.utils.tensorboard.SummaryWriter``.

``tensorboard`` is an optional dependency (``pip install 'gradientmail[tensorboard]'``),
imported when the sink is made.
"""

import os
from typing import Any

from gradientmail.events.kinds import (
    Event,
    FragmentAligned,
    RoundCommitted,
    RoundRecorded,
    SnapshotPublished,
    StepsDropped,
)

__all__ = ["TAGS", "TensorBoardSink", "tensorboard"]

TAGS = {
    "gradientmail/rounds_committed": "rounds committed in the run, as this node read them",
    "gradientmail/participants": "learners whose snapshots a round averaged (x: round)",
    "gradientmail/quorum_seconds": "how long a round waited for its quorum (x: round)",
    "gradientmail/grace_seconds": "how long it then waited for late snapshots (x: round)",
    "gradientmail/commit_seconds": "writing a round this node closed (x: round)",
    "gradientmail/steps_dropped": "this learner's steps no round will carry, cumulative",
    "gradientmail/bytes_up": "bytes of this learner's published snapshots, cumulative",
    "gradientmail/bytes_down": "bytes of the updates of the versions it applied, cumulative",
    "gradientmail/versions_behind": "how many versions a fragment trailed when aligned",
    "gradientmail/lag_steps": "local steps between a snapshot and applying its round",
}
"""Every scalar the sink writes, and what it is. The x axis of the first five is the round;
of the others this learner's local step (the newest the sink has seen, from
``FragmentAligned``)."""


def _summary_writer(log_dir: str, flush_secs: float) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "gradientmail.events.tensorboard needs the tensorboard package: "
            "pip install 'gradientmail[tensorboard]'"
        ) from exc
    return SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)


class TensorBoardSink:
    """The sink ``tensorboard`` returns; the bus calls it with each event on the node's
    event-loop thread and ``close()`` (which flushes the file) after the last one. A writer
    call only queues the value for ``SummaryWriter``'s own writer thread."""

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_secs: float = 10.0) -> None:
        self._writer = _summary_writer(os.fspath(log_dir), flush_secs)
        self.log_dir = os.fspath(log_dir)
        self._step = 0
        self._rounds = 0
        self._dropped = 0
        self._up = 0
        self._down = 0
        self._newest: dict[int, tuple[int, int]] = {}
        self._update_size: dict[int, tuple[int, int]] = {}

    def __call__(self, event: Event) -> None:
        match event:
            case RoundRecorded(record=record):
                self._rounds += 1
                self._newest[record.fragment] = (record.version, record.round)
                self._update_size[record.round] = (record.fragment, record.update.size)
                self._scalar("rounds_committed", self._rounds, record.round)
                self._scalar("participants", len(record.participants), record.round)
                self._scalar("quorum_seconds", record.quorum_seconds, record.round)
                self._scalar("grace_seconds", record.grace_seconds, record.round)
            case RoundCommitted(record=record, seconds=seconds):
                self._scalar("commit_seconds", seconds, record.round)
            case FragmentAligned():
                self._step = max(self._step, event.local_step)
                newest, _ = self._newest.get(event.fragment, (event.version, event.round))
                self._down += self._update_size.pop(event.round, (event.fragment, 0))[1]
                # A fragment aligned past a round never applies that round's update.
                for round, (fragment, _) in list(self._update_size.items()):
                    if fragment == event.fragment and round < event.round:
                        del self._update_size[round]
                self._scalar("versions_behind", max(0, newest - event.version), self._step)
                self._scalar("bytes_down", self._down, self._step)
                if event.lag_steps is not None:
                    self._scalar("lag_steps", event.lag_steps, self._step)
            case SnapshotPublished(size=size):
                self._up += size
                self._scalar("bytes_up", self._up, self._step)
            case StepsDropped(steps=steps):
                self._dropped += steps
                self._scalar("steps_dropped", self._dropped, self._step)
            case _:
                pass

    def _scalar(self, name: str, value: float, step: int) -> None:
        self._writer.add_scalar(f"gradientmail/{name}", value, global_step=step)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

    def __repr__(self) -> str:
        return f"tensorboard({self.log_dir!r})"


def tensorboard(log_dir: str | os.PathLike[str], *, flush_secs: float = 10.0) -> TensorBoardSink:
    """A sink writing the scalars in ``TAGS`` to an event file in ``log_dir`` (created if
    missing), for ``tensorboard --logdir``. Give each node its own ``log_dir`` (e.g.
    ``runs/{learner}``): TensorBoard shows each directory as one run. ``flush_secs``: how
    often the writer flushes while the node runs. Raises ``ImportError`` naming the extra
    when tensorboard is not installed."""
    return TensorBoardSink(log_dir, flush_secs=flush_secs)
