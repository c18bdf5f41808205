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
from lockstep.runtime.replicate import broadcast_tensors

if TYPE_CHECKING:
    from lockstep.engine.live import LiveDDP


class BufferSync:
    """The wrapper's buffer and input handling (reads `module`, `ctx`, `process_group`)."""

    module: nn.Module
    ctx: DistContext
    process_group: dist.ProcessGroup
    forward_sync_buffers: bool
    require_forward_param_sync: bool
    device_ids: list[int | torch.device] | None
    _live: LiveDDP | None
    _buffer_owners: list[nn.Module]

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def note_buffer_owners(self) -> None:
        """At wrap time: the submodules that hold buffers (torch too takes the module's
        buffers once, at wrap time). Walking `module.buffers()` at every forward instead
        cost 0.6 ms per step on 200 layers without any buffer."""
        self._buffer_owners = [m for m in self.module.modules() if m._buffers]

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's rule)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and any(b is not None for m in self._buffer_owners for b in m._buffers.values())
        )

    def sync_buffers(self, src_rank: int) -> None:
        """Broadcast buffers from group rank `src_rank` (0, or under Join the owner)."""
        if self._live is not None:  # a lost rank recovered inside (`engine/live_buffers.py`)
            self._live.buffers.sync(src_rank)
            return
        buffers = [b for _, b in self.module.named_buffers() if not getattr(b, "_ddp_ignored", 0)]
        if buffers and self.ctx.world_size > 1:
            src = self.ctx.global_rank(src_rank)
            broadcast_tensors(buffers, src=src, process_group=self.process_group)

    def to_device(self, tree: Any) -> Any:
        """Every tensor in `tree` moved to `device_ids[0]` (non-blocking)."""
        assert self.device_ids is not None
        device = self.device_ids[0]
        device = torch.device("cuda", device) if isinstance(device, int) else device
        return tree_map(
            lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x,
            tree,
        )
