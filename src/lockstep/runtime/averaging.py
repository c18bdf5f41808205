"""`Averaging`: the 1/N rule, decided once per bucket dtype by the bucket collective.

A bucket (`runtime/bucket.py`) applies it while gradients arrive; a bucket
collective (`runtime/bucket_collective.py`) chooses it. It sits apart from both
so that neither imports the other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Averaging:
    """How the engine divides a bucket's gradients by the world size before the sum.

    A copied gradient is multiplied by `multiplier` while it is copied (one pass);
    a gradient found in place (a bucket view) is divided by `divisor` with its
    bucket. The multiplier is 1/N as a 0-dim tensor, float32 except for float64
    buckets: the CPU kernels read it in the op's math type, as torch DDP's wrapped
    double scalar, so the bits are torch's.
    """

    divisor: int
    multiplier: torch.Tensor
    copies_divided: bool = False  # batched_grad_copy: copies too are divided with the bucket

    @classmethod
    def for_dtype(cls, world_size: int, dtype: torch.dtype, batched: bool = False) -> Averaging:
        scalar_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return cls(world_size, torch.tensor(1.0 / world_size, dtype=scalar_dtype), batched)
