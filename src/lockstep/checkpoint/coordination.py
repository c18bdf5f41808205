"""How the ranks of a checkpoint wait for each other and share one outcome.

Rank 0 acts (writes, commits, finds), the others wait at a barrier with the
checkpointer's own timeout whose error says what they waited for; rank 0's
answer is broadcast; every rank's error is exchanged so that all raise the same
`CheckpointError`. Both formats (`checkpointer.py`, `dcp_checkpointer.py`) use it.
Small CPU messages go over a gloo group (NCCL has no timed barrier).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep.errors import CheckpointError


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
        try:
            # A barrier's own wait is bounded by the group's timeout; this one by ours.
            dist.barrier(group=self.group, async_op=True).wait(timeout=self.timeout)
        except RuntimeError as error:
            seconds = self.timeout.total_seconds()
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
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def to_rank0(self, value: Any) -> list[Any]:
        """On rank 0, every rank's `value` by rank; an empty list elsewhere."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, gathered, group=self.group, group_dst=0)
        return gathered or []

    def everyone(self, value: Any) -> list[Any]:
        """Every rank's `value` by rank, on every rank."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def raise_if_any(self, error: str | None) -> None:
        """Exchange every rank's error (or None) and raise the same error on every rank."""
        by_text: dict[str, list[int]] = {}
        for rank, text in enumerate(self.everyone(error)):
            if text is not None:
                by_text.setdefault(text, []).append(rank)
        if by_text:
            lines = "; ".join(f"on rank(s) {ranks}: {text}" for text, ranks in by_text.items())
            raise CheckpointError(f"restore failed (raised on rank {self.rank}) {lines}")
