"""`NaiveDataParallel`: data parallelism as the textbook draws it. The teaching step and the oracle.

At construction, rank 0's parameters and buffers are broadcast so every replica
starts equal. After `loss.backward()`, one call, `sync_gradients()`, all-reduces
every gradient, one tensor at a time, and divides by the world size. Nothing
overlaps and nothing is bucketed: this is the reference the fast engine
(`lockstep.DistributedDataParallel`) is tested against, not the path to train on.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from lockstep.context import group_context
from lockstep.runtime.replicate import broadcast_module


class NaiveDataParallel(nn.Module):
    """Wrap `module`; call `sync_gradients()` after each backward.

    Args:
        module: the model; every rank must build the same architecture.
        process_group: the group to average over; the default group when None.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        ctx = group_context(process_group, "NaiveDataParallel")
        broadcast_module(module, ctx.global_rank(0), process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        """All-reduce (sum) every gradient, then divide by the world size.

        Parameters without a gradient are skipped, so every rank must produce the
        same set of gradients (the bucketed engine lifts that restriction).
        """
        world_size = dist.get_world_size(self.process_group)
        for param in self.module.parameters():
            if param.grad is None:
                continue
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.process_group)
            param.grad.div_(world_size)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict: same keys as without the wrapper."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
