"""Which gradients travel together: the pure bucket-assignment function.

Before training starts (and once more after the first iteration) the engine
groups the trainable parameters into buckets. One bucket is one flat buffer
and one all-reduce; the first bucket is small so that communication can start
early in backward. Nothing here touches a process group, so it is unit-tested
without processes.

The rule, as torch DDP applies it: walk the parameters in the order their
gradients are expected to become ready (reverse registration order at first,
the observed order after the rebuild); keep one open bucket per (dtype,
device); add the parameter to it, and close the bucket as soon as its size
reaches the current cap. The first bucket of each (dtype, device) uses the
first cap, later ones the main cap. A parameter is never split, so a bucket
can exceed its cap by its last parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What bucketing needs to know about one trainable parameter."""

    index: int
    name: str
    numel: int
    element_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that take part in the all-reduce, in registration order.

    Only parameters with requires_grad travel (frozen weights, such as a LoRA base
    model, never do), and a tied parameter is counted once, under its first name.
    """
    seen: set[int] = set()
    out = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def param_specs(named: Sequence[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """Describe parameters for `assign_buckets`; index i is the i-th of `named`."""
    return [
        ParamSpec(i, name, p.numel(), p.element_size(), p.dtype, p.device)
        for i, (name, p) in enumerate(named)
    ]


def assign_buckets(
    specs: Sequence[ParamSpec],
    order: Sequence[int] | None = None,
    *,
    first_cap_bytes: int = 1 * MB,
    cap_bytes: int = 25 * MB,
    cap_list: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group parameters into buckets.

    Args:
        specs: the trainable parameters, `specs[i].index == i`.
        order: indices in expected gradient-ready order; reverse registration order
            (the usual backward order) when None.
        first_cap_bytes: cap of the first bucket of each (dtype, device).
        cap_bytes: cap of every later bucket.
        cap_list: per-bucket caps instead (torch's bucket_cap_mb_list): the k-th bucket of
            each (dtype, device) uses cap_list[k], the last one for all after it.

    Returns:
        Buckets in launch order, each a list of parameter indices in ready order.

    Raises:
        ValueError: a cap is not positive, or `order` is not a permutation of the indices.
    """
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError(
            f"bucket caps must be positive; found first_cap_bytes={first_cap_bytes}, "
            f"cap_bytes={cap_bytes}. Pass bucket_cap_mb > 0 and first_bucket_cap_mb > 0."
        )
    order = list(range(len(specs) - 1, -1, -1)) if order is None else list(order)
    if sorted(order) != list(range(len(specs))):
        raise ValueError(
            f"order must list each of the {len(specs)} parameter indices once; found {order}"
        )
    closed: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    caps = list(cap_list) if cap_list else [first_cap_bytes, cap_bytes]
    counts: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in order:
        spec = specs[index]
        key = (spec.dtype, spec.device)
        open_buckets.setdefault(key, []).append(index)
        sizes[key] = sizes.get(key, 0) + spec.nbytes
        if sizes[key] >= caps[min(counts.get(key, 0), len(caps) - 1)]:
            closed.append(open_buckets.pop(key))
            sizes[key] = 0
            counts[key] = counts.get(key, 0) + 1
    closed.extend(bucket for bucket in open_buckets.values() if bucket)
    return closed
