"""`ShardGrad`: a shard's gradient that torch's whole-model norms read as the whole.

torch's `clip_grad_norm_` and `get_total_norm` take the norm of each gradient with
`torch.linalg.vector_norm` (or `torch._foreach_norm`), then the norm of those norms.
On a shard each of those is this rank's part only, and the clip is silently wrong.
The sharded engine hands its shard gradients out as `ShardGrad`, which answers those
two calls with the norm over every rank's part (one all-reduce per call, on every
rank, as FSDP2's DTensor gradients do) and runs every other operation unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class ShardGrad(torch.Tensor):
    """The gradient of this rank's shard; norms over the whole tensor span every rank."""

    process_group: dist.ProcessGroup | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.linalg.vector_norm and _whole_tensor(args, kwargs):
            return global_norms([args[0]], _ord(args, kwargs), kwargs.get("dtype"))[0]
        if func is torch._foreach_norm:
            return global_norms(list(args[0]), _ord(args, kwargs), kwargs.get("dtype"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def as_shard_grad(grad: torch.Tensor, process_group: dist.ProcessGroup | None) -> ShardGrad:
    """`grad` (same storage) as a `ShardGrad` over `process_group`."""
    out = grad.as_subclass(ShardGrad)
    out.process_group = process_group
    return out


def global_norms(
    tensors: list[torch.Tensor], ord: float, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """The `ord`-norm of each tensor over every rank's part, with one all-reduce.

    Every rank must call it with its parts of the same tensors, in the same order.
    """
    group = next((t.process_group for t in tensors if isinstance(t, ShardGrad)), None)
    with torch._C.DisableTorchFunctionSubclass():
        local = torch.stack([torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors])
        if math.isinf(ord):
            op = dist.ReduceOp.MAX if ord > 0 else dist.ReduceOp.MIN
            dist.all_reduce(local, op=op, group=group)
            return list(local.unbind())
        power = local if ord == 0 else local.pow(ord)
        dist.all_reduce(power, group=group)
        return list((power if ord == 0 else power.pow(1.0 / ord)).unbind())


def _whole_tensor(args: tuple, kwargs: dict) -> bool:
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    return dim is None


def _ord(args: tuple, kwargs: dict) -> float:
    return float(args[1] if len(args) > 1 else kwargs.get("ord", 2.0))
