"""delay_all_reduce_named_params: parameters averaged in one all-reduce, later than the rest.

torch's `delay_all_reduce_named_params` with `param_to_hook_all_reduce`: the
named parameters leave the buckets. Their gradients accumulate in one flat
buffer of their own (`.grad` are views into it, set after each forward); when
the gradient of `param_to_hook_all_reduce` is computed, the buffer is divided by
the world size and all-reduced, asynchronously; the end of backward waits for
it. As in torch this happens on every backward, under `no_sync()` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lockstep.runtime.replicate import broadcast_tensors
from lockstep.runtime.streams import at_backward_end

if TYPE_CHECKING:
    from lockstep.engine.args import DDPArguments


class DelayedAllReduce:
    """The delayed parameters' flat gradient buffer and the hook that all-reduces it.

    Args:
        params: the delayed parameters, in the order given.
        hook_param: the parameter whose gradient starts the all-reduce.
        process_group: the replicas' group.
        world_size: its size (the divisor).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        hook_param: nn.Parameter,
        process_group: dist.ProcessGroup,
        world_size: int,
    ) -> None:
        self.params = list(params)
        self.group, self.world_size = process_group, world_size
        self.buffer = torch.zeros(
            sum(p.numel() for p in self.params),
            dtype=self.params[0].dtype,
            device=self.params[0].device,
        )
        self.views, offset = [], 0
        for param in self.params:
            self.views.append(self.buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        hook_param.register_hook(self._on_grad)

    def broadcast_from(self, src: int) -> None:
        """At wrap time: every rank starts from global rank `src`'s values."""
        broadcast_tensors(self.params, src=src, process_group=self.group)

    def point_grads_at_buffer(self) -> None:
        """After a forward: `.grad` of each delayed parameter is its view (torch's rule)."""
        all_none = all(p.grad is None for p in self.params)
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is None:
                param.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.buffer.div_(self.world_size)
        work = dist.all_reduce(self.buffer, group=self.group, async_op=True)
        at_backward_end(work.wait)  # the caller's stream waits for the sum
        return grad


def build_delayed(
    args: DDPArguments, process_group: dist.ProcessGroup, world_size: int
) -> DelayedAllReduce | None:
    """The delayed all-reduce the arguments ask for, or None."""
    if not args.delay_all_reduce_named_params:
        return None
    assert args.param_to_hook_all_reduce is not None
    params = [p for _, p in args.delay_all_reduce_named_params]
    return DelayedAllReduce(params, args.param_to_hook_all_reduce, process_group, world_size)
