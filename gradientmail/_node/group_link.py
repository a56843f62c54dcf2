"""This rank's end of a learner group (``_node.group_member``): the checks of the process group a
node is given (``link_of``) and the collectives between its ranks (``GroupLink``), each
bounded by ``NodeOptions.group_timeout`` or the process group's own timeout. Its methods
block: they run in ``anyio.to_thread`` worker threads only, never on the event-loop
thread."""

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from gradientmail.errors import GroupFailed
from gradientmail.protocol.group import (
    Kind,
    Message,
    PartReport,
    Summed,
    contribution,
    read,
    verdict,
)

__all__ = ["GroupLink", "link_of"]

_reports_decoder = msgspec.msgpack.Decoder(list[PartReport])


def link_of(group: object, timeout: float, *, model: bool) -> "GroupLink | None":
    """The link of this rank to ``group`` (None for no group, or a group of one rank).
    Raises ``TypeError``/``ValueError`` naming what to fix for anything that is not an
    initialized gloo process group, or for a rank without a ``model``."""
    if group is None:
        return None
    if not model:
        raise ValueError("every rank of a learner group (group=) passes its model")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group= needs torch.distributed initialized (dist.init_process_group) on every rank"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {group!r}")
    backend = dist.get_backend(group)
    if backend != "gloo":
        raise ValueError(
            f"group is a {backend!r} process group; a learner group exchanges CPU tensors: "
            "pass dist.new_group(backend='gloo') (your model may keep its own NCCL group)"
        )
    if dist.get_world_size(group) == 1:
        return None
    return GroupLink(group, timeout)


class GroupLink:
    """This rank's end of its learner group. Every method but ``leader`` blocks on a
    collective: call it from a worker thread, never from the event-loop thread. ``sent`` and
    ``received`` count the payload bytes of the collectives (control vectors and the
    fragments broadcast), not the transport's own."""

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0)
        self.timeout = timedelta(seconds=timeout)
        self.broken = False
        self.sent = 0
        self.received = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def control(
        self, message: Message, expected: Kind, fragments: int, *, bounded: bool = True
    ) -> Summed:
        """Exchange ``message``; the group's sum. Raises ``GroupFailed`` when a rank aborted,
        the ranks are out of step, or the exchange failed or timed out (``bounded``: within
        ``group_timeout``, else the process group's own timeout). An abort is never judged:
        it only completes the exchange the others wait in."""
        values = torch.tensor(contribution(message, fragments), dtype=torch.int64)
        work = dist.all_reduce(values, group=self.group, async_op=True)
        self._wait(work, bounded, f"the {expected} exchange")
        self.sent += values.nbytes
        self.received += values.nbytes
        summed = read(values.tolist(), fragments)
        if message.kind == "abort":
            return summed
        problem = verdict(summed, expected, self.world)
        if problem is not None:
            self.broken = True
            raise GroupFailed(f"learner group, rank {self.rank}: {problem}")
        return summed

    def share(self, tensors: Sequence[Tensor]) -> None:
        """Broadcast ``tensors`` from the leader; a follower's are overwritten in place
        (staged through a CPU copy when they are not contiguous CPU tensors)."""
        for tensor in tensors:
            buffer = tensor.detach()
            staged = buffer.device.type != "cpu" or not buffer.is_contiguous()
            if staged:
                buffer = buffer.to("cpu", copy=True).contiguous()
            work = dist.broadcast(buffer, src=self.src, group=self.group, async_op=True)
            self._wait(work, True, "a fragment's broadcast")
            if self.leader:
                self.sent += buffer.nbytes
            else:
                self.received += buffer.nbytes
                if staged:
                    with torch.no_grad():
                        tensor.copy_(buffer)

    def share_bytes(self, data: bytes, size: int) -> bytes:
        """The leader's ``data`` of ``size`` bytes (the size the control exchange carried),
        on every rank."""
        if size == 0:
            return b""
        if self.leader:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(size, dtype=torch.uint8)
        work = dist.broadcast(buffer, src=self.src, group=self.group, async_op=True)
        self._wait(work, True, "the log's broadcast")
        if self.leader:
            self.sent += size
            return data
        self.received += size
        return buffer.numpy().tobytes()

    def gather_reports(self, reports: Sequence[PartReport]) -> list[PartReport]:
        """Every rank's ``reports``, in rank order."""
        data = msgspec.msgpack.encode(list(reports))
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        work = dist.all_gather(sizes, size, group=self.group, async_op=True)
        self._wait(work, True, "the part reports' exchange")
        longest = max(int(s.item()) for s in sizes)
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        work = dist.all_gather(gathered, buffer, group=self.group, async_op=True)
        self._wait(work, True, "the part reports' exchange")
        self.sent += len(data)
        found: list[PartReport] = []
        for rank, (count, part) in enumerate(zip(sizes, gathered, strict=True)):
            if rank != self.rank:
                self.received += int(count.item())
            found.extend(_reports_decoder.decode(part[: int(count.item())].numpy().tobytes()))
        return found

    def share_object(self, value: Any) -> Any:
        """The leader's ``value`` (picklable), on every rank; bounded by the process
        group's own timeout (the leader may still be joining the run)."""
        box = [value if self.leader else None]
        try:
            dist.broadcast_object_list(box, src=self.src, group=self.group)
        except RuntimeError as exc:
            raise self._failed("the entry exchange", exc) from exc
        return box[0]

    def _wait(self, work: Any, bounded: bool, what: str) -> None:
        try:
            if bounded:
                work.wait(timeout=self.timeout)
            else:
                work.wait()
        except RuntimeError as exc:  # gloo's timeout, and a peer's closed connection
            raise self._failed(what, exc) from exc

    def _failed(self, what: str, exc: RuntimeError) -> GroupFailed:
        self.broken = True
        return GroupFailed(
            f"learner group, rank {self.rank}: {what} did not complete ({exc}); a rank died, "
            f"hung or left (waited up to {self.timeout.total_seconds():g} s, "
            "NodeOptions.group_timeout)"
        )
