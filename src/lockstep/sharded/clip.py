"""`clip_grad_norm_` over shards: the global gradient norm, as if nothing were sharded.

Each rank holds the gradient of its shard only, so the norm is assembled from
every rank's part: the sum of |g|^p all-reduced (the maximum for p = inf),
then the p-th root. Padding holds zeros and adds nothing. The clip coefficient
follows torch's `clip_grad_norm_`: max_norm / (norm + 1e-6), at most 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lockstep.runtime.control_device import control_device


def clip_grad_norm_(
    shards: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale the shards' gradients in place so the global norm is at most `max_norm`.

    Args:
        shards: this rank's shard parameters (their `.grad` is clipped).
        max_norm: the largest norm allowed.
        norm_type: p of the p-norm; float("inf") for the largest magnitude.
        process_group: the group the shards are spread over.

    Returns:
        The global norm before clipping (the same on every rank), a float32 0-dim tensor.
    """
    grads = [p.grad for p in shards if p.grad is not None]
    infinite = math.isinf(norm_type)
    wire = control_device(process_group)  # NCCL reads CUDA tensors only, gloo CPU ones
    local = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else wire)
    for grad in grads:
        part = grad.detach().abs().float()
        local = torch.maximum(local, part.max()) if infinite else local + part.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    summed = local.to(wire)
    dist.all_reduce(summed, op=op, group=process_group)
    local = summed.to(local.device)
    total = local if infinite else local.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coef.to(grad.dtype))
    return total
