"""How the ranks of a checkpoint wait for each other and share one outcome.

Rank 0 acts (writes, commits, finds), the others wait at a barrier with the
checkpointer's own timeout whose error says what they waited for; rank 0's
answer is broadcast; every rank's error is exchanged so that all raise the same
`CheckpointError`. Both formats (`checkpointer.py`, `dcp_checkpointer.py`) use it.
Small CPU messages go over a gloo group (NCCL has no timed barrier). Each message is
pickled into a byte tensor and sent by the backend's own asynchronous collectives
(a size, then the bytes), waited by `runtime/waits.block`: under live recovery a
rank lost meanwhile ends the wait (`waits.Interrupted`) instead of the group's timeout.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import CheckpointError
from lockstep.runtime import waits
from lockstep.runtime.handles import WorkHandle


def coordination_group(
    process_group: dist.ProcessGroup | None, world_size: int
) -> dist.ProcessGroup | None:
    """A gloo group for the small CPU messages and the timed barrier (NCCL has neither)."""
    if world_size == 1 or dist.get_backend(process_group) == "gloo":
        return process_group
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return dist.new_group(ranks=ranks, backend="gloo")


class Coordination:
    """The checkpoint's messages between ranks; every method is called on every rank."""

    def __init__(
        self, rank: int, world_size: int, group: dist.ProcessGroup | None, timeout: timedelta
    ) -> None:
        self.rank, self.world_size, self.group, self.timeout = rank, world_size, group, timeout

    def wait_for_rank0(self, what: str) -> None:
        """A barrier with this checkpointer's timeout, whose error says what was awaited."""
        if self.world_size == 1:
            return
        seconds = self.timeout.total_seconds()
        try:
            # A barrier's own wait is bounded by the group's timeout; this one by ours.
            _finish(dist.barrier(group=self.group, async_op=True), seconds)
        except waits.Interrupted:
            raise  # a rank was lost: live recovery takes it from here (`live_save.py`)
        except RuntimeError as error:
            if self.rank != 0:
                raise CheckpointError(
                    f"rank {self.rank} timed out after {seconds:.0f} s waiting for rank 0's "
                    f"{what}; rank 0 may be stuck (slow or full disk) or dead. Read rank 0's "
                    "log, or give the Checkpointer a longer timeout_s."
                ) from error
            raise CheckpointError(
                f"rank 0 finished its {what} but not every rank reached the barrier after it "
                f"within {seconds:.0f} s: {error}"
            ) from error

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        if self.world_size == 1:
            return value
        data = _encode(value) if self.rank == 0 else _EMPTY
        size = torch.tensor([data.numel()], dtype=torch.int64)
        _finish(dist.broadcast(size, group=self.group, async_op=True, group_src=0))
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        _finish(dist.broadcast(data, group=self.group, async_op=True, group_src=0))
        return _decode(data)

    def to_rank0(self, value: Any) -> list[Any]:
        """On rank 0, every rank's `value` by rank; an empty list elsewhere."""
        if self.world_size == 1:
            return [value]
        data, sizes = self._padded(value)
        slots = [torch.empty_like(data) for _ in sizes] if self.rank == 0 else None
        _finish(dist.gather(data, slots, group=self.group, async_op=True, group_dst=0))
        return [_decode(slot[:n]) for slot, n in zip(slots, sizes, strict=True)] if slots else []

    def everyone(self, value: Any) -> list[Any]:
        """Every rank's `value` by rank, on every rank."""
        if self.world_size == 1:
            return [value]
        data, sizes = self._padded(value)
        slots = [torch.empty_like(data) for _ in sizes]
        _finish(dist.all_gather(slots, data, group=self.group, async_op=True))
        return [_decode(slot[:n]) for slot, n in zip(slots, sizes, strict=True)]

    def _padded(self, value: Any) -> tuple[torch.Tensor, list[int]]:
        """`value`'s bytes padded to the longest rank's, and every rank's length."""
        data = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        mine = torch.tensor([data.numel()], dtype=torch.int64)
        _finish(dist.all_gather(sizes, mine, group=self.group, async_op=True))
        lengths = [int(n.item()) for n in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: data.numel()] = data
        return padded, lengths

    def raise_if_any(self, error: str | None) -> None:
        """Exchange every rank's error (or None) and raise the same error on every rank."""
        by_text: dict[str, list[int]] = {}
        for rank, text in enumerate(self.everyone(error)):
            if text is not None:
                by_text.setdefault(text, []).append(rank)
        if by_text:
            lines = "; ".join(f"on rank(s) {ranks}: {text}" for text, ranks in by_text.items())
            raise CheckpointError(f"restore failed (raised on rank {self.rank}) {lines}")


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _encode(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


def _decode(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def _finish(work: dist.Work | None, timeout_s: float | None = None) -> None:
    """Wait for one of the messages' collectives (interruptible under live recovery)."""
    assert work is not None
    waits.block(WorkHandle(work), timeout_s)
