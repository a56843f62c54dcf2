"""What a restarted learner needs besides the weights the run gives it back on joining: its
inner optimizer's state, its step count and its position in the data.

``LocalState(path)`` keeps them in one local file per learner, replaced atomically by each
``save`` (a crash mid-save leaves the previous one). The model's weights are not in it: on
joining, the node replaces them with the run's newest committed ones. See the "Resume"
recipe in ``docs/integrations.md``. A nested loop saves ``position=(epoch, batch)`` and
skips what ``Resumed.trained(epoch, batch)`` says it trained before the restart.
"""

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["LocalState", "Resumed"]

_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Resumed:
    """What ``LocalState.load`` found: the step count and data position saved last, and the
    ``extra`` mapping given to ``save`` (the optimizer's state is already loaded)."""

    step: int
    position: Any
    extra: dict[str, Any] = field(default_factory=dict)

    def trained(self, *position: int) -> bool:
        """Whether a nested loop's position ``position`` (``epoch, batch``: ints, outer
        first) is at or before the saved ``position`` (a tuple of as many ints), compared
        in order: a resumed loop skips it. False when nothing was saved (``position`` None,
        as in ``Resumed(step=0, position=None)`` for a first start). Raises ``ValueError``
        when the saved position is not such a tuple."""
        if self.position is None:
            return False
        saved = self.position
        if (
            not isinstance(saved, tuple)
            or len(saved) != len(position)
            or not all(isinstance(i, int) for i in saved)
        ):
            raise ValueError(
                f"the saved position {saved!r} is not a tuple of {len(position)} ints: save "
                "position=(epoch, batch) to resume a nested loop with trained(epoch, batch)"
            )
        return position <= saved


class LocalState:
    """One learner's local state in the file ``path`` (its directory is created on save).
    Methods run on the caller's thread and do blocking file I/O: call them from the
    training loop, between steps."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def save(
        self,
        *,
        step: int = 0,
        optimizer: torch.optim.Optimizer | None = None,
        position: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Write ``step`` (a loop's own step count, if it keeps one),
        ``optimizer.state_dict()``, ``position`` (anything ``torch.save`` takes: an index,
        ``(epoch, batch)``, a sampler's state, a dict) and ``extra``, replacing the previous
        file only once the new one is complete on disk."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        payload = {
            "format": _FORMAT,
            "step": step,
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "position": position,
            "extra": dict(extra or {}),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(payload, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def load(self, *, optimizer: torch.optim.Optimizer | None = None) -> Resumed | None:
        """None when nothing was saved yet (a first start); else load the saved optimizer
        state into ``optimizer`` (built over the same parameters, as at save time) and
        return the rest. Raises ``ValueError`` naming the file when it is not a state this
        class wrote, or holds an optimizer state and no ``optimizer`` was given. The file
        is unpickled (``position`` and ``extra`` may be any object): load only files your
        own learner wrote."""
        if not self.path.exists():
            return None
        try:
            payload = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ValueError(f"{self.path} is not a learner's local state: {exc}") from exc
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise ValueError(f"{self.path} is not a learner's local state (format {_FORMAT})")
        if payload["optimizer"] is not None:
            if optimizer is None:
                raise ValueError(
                    f"{self.path} holds an optimizer state: pass load(optimizer=...) to restore it"
                )
            optimizer.load_state_dict(payload["optimizer"])
        return Resumed(step=payload["step"], position=payload["position"], extra=payload["extra"])
