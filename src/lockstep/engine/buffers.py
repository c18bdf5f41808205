"""Buffers and inputs before a DDP forward: rank 0's buffers to every rank, inputs to the device.

`BufferSync` is mixed into `DistributedDataParallel`: torch's rule for when a
forward broadcasts the module's buffers (`will_sync_module_buffers`), the
broadcast itself (from group rank 0, or under Join from the rank that owns the
model), torch's older spelling `broadcast_buffers`, and the move of inputs to
`device_ids[0]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from lockstep.context import DistContext
from lockstep.runtime import recovery
from lockstep.runtime.recovery import Point
from lockstep.runtime.replicate import copy_back, flattened

if TYPE_CHECKING:
    from lockstep.engine.reducer import Reducer


class BufferSync:
    """The wrapper's buffer and input handling (reads `module`, `ctx`, `process_group`)."""

    module: nn.Module
    ctx: DistContext
    process_group: dist.ProcessGroup
    forward_sync_buffers: bool
    require_forward_param_sync: bool
    device_ids: list[int | torch.device] | None
    reducer: Reducer

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's rule)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and any(True for _ in self.module.buffers())
        )

    def broadcast_buffers_named(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a forward broadcasts, by name (torch's `_ddp_ignored` ones left out)."""
        named = self.module.named_buffers()
        return [(n, b) for n, b in named if not getattr(b, "_ddp_ignored", False)]

    def sync_buffers(self, src_rank: int) -> None:
        """Broadcast buffers from group rank `src_rank` (0, or under Join the owner).

        A recovery point at the step's start (`runtime/recovery.py`): after a rank lost
        in it was recovered live, this rank takes what the broadcast carries from rank
        0's post, or keeps its own buffers when its peers' broadcast already matched them.
        """
        named = self.broadcast_buffers_named()
        if not named or self.ctx.world_size == 1:
            return
        src, group = self.ctx.global_rank(src_rank), self.process_group
        chunks = list(flattened([b for _, b in named]))  # small: a model's buffers

        def launch() -> list[dist.Work]:  # all launched, then waited: one wait's latency
            return [dist.broadcast(flat, src=src, group=group, async_op=True) for _, flat in chunks]

        outcome = recovery.run(Point.BUFFERS, self.reducer.driver.steps + 1, launch)
        if outcome.ran:
            for chunk, flat in chunks:
                copy_back(chunk, flat)
        elif outcome.value is not None:
            with torch.no_grad():
                for name, buffer in named:
                    buffer.copy_(outcome.value[name])

    def to_device(self, tree: Any) -> Any:
        """Every tensor in `tree` moved to `device_ids[0]` (non-blocking)."""
        assert self.device_ids is not None
        device = self.device_ids[0]
        device = torch.device("cuda", device) if isinstance(device, int) else device
        return tree_map(
            lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x,
            tree,
        )
