"""mixed_precision: torch's `_MixedPrecision` (param, reduce and buffer dtypes) on this engine.

Outside forward and backward the parameters stay in full precision (the
optimizer and checkpoints see them so). Before each forward `MixedPrecision`
swaps every parameter's data for a `param_dtype` copy and casts floating inputs
to it, so forward and backward compute in that dtype and gradients arrive in
it. Buckets keep the full dtype, which holds those values exactly; the bucket
collective `MixedPrecisionReduce` sums them in `reduce_dtype`, divides by the
world size and rounds the result back to `param_dtype`: torch's order of
operations, so the bits are torch's. When the synchronised step ends the
parameters get their full-precision data back and gradients are upcast.
Buffers are cast to `buffer_dtype` once, at wrap time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.utils import _cast_forward_inputs

from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.handles import CollectiveHandle
from lockstep.runtime.transport import Transport


class _Rounded:
    """A reduce_dtype all-reduce in flight; when done, averaged and rounded into the bucket."""

    def __init__(self, inner: CollectiveHandle, wire: torch.Tensor, bucket: Bucket, n: int, dtype):
        self.inner, self.wire, self.bucket = inner, wire, bucket
        self.divisor, self.param_dtype = n, dtype
        self.done_at = 0.0

    def poll(self) -> bool:
        if not self.done_at and self.inner.poll():
            self._finish()
        return bool(self.done_at)

    def wait(self) -> None:
        self.inner.wait()  # also once done: a failed work raises here
        if not self.done_at:
            self._finish()

    def _finish(self) -> None:
        self.wire.div_(self.divisor)
        self.bucket.buffer.copy_(self.wire.to(self.param_dtype))
        self.done_at = self.inner.done_at or time.perf_counter()


class MixedPrecisionReduce:
    """The bucket collective under mixed precision: sum in reduce_dtype, then average."""

    def __init__(self, transport: Transport, world_size: int, param_dtype, reduce_dtype) -> None:
        self.transport, self.world_size = transport, world_size
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype or param_dtype

    def averaging(self, dtype: torch.dtype) -> Averaging | None:
        return None  # gradients enter the bucket unscaled, as torch's hook receives them

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        wire = bucket.buffer.to(self.reduce_dtype)
        handle = self.transport.all_reduce(wire)
        return _Rounded(handle, wire, bucket, self.world_size, self.param_dtype)

    def sent_bytes(self) -> int | None:
        return None

    def issues_inline(self) -> bool:
        return self.transport.inline


class MixedPrecision:
    """Swaps parameters to param_dtype around forward-backward (see the module docstring).

    Args:
        config: torch's `_MixedPrecision` (param_dtype, reduce_dtype, buffer_dtype).
        params: the parameters to cast (ignored ones excluded).
        buffers: the buffers to cast once.
    """

    def __init__(self, config: Any, params: list[nn.Parameter], buffers: list[torch.Tensor]):
        self.dtype = config.param_dtype
        self.params = params
        self._full: list[torch.Tensor | None] = [None] * len(params)
        if config.buffer_dtype is not None:
            for buffer in buffers:
                buffer.data = buffer.to(config.buffer_dtype)

    def before_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Parameters (and their gradients) to param_dtype; floating inputs too."""
        if self.dtype is None:
            return args, kwargs
        for i, param in enumerate(self.params):
            if self._full[i] is None:  # not cast already (a no_sync forward came before)
                self._full[i] = param.data
                param.data = param.data.to(self.dtype)
                if param.grad is not None:
                    param.grad.data = param.grad.to(self.dtype)
        return _cast_forward_inputs(self.dtype, *args, **kwargs)

    def after_step(self) -> None:
        """The synchronised step is over: full-precision data back, gradients upcast."""
        for i, param in enumerate(self.params):
            full = self._full[i]
            if full is None:
                continue
            grad, param.grad = param.grad, None
            param.data = full
            if grad is not None:
                param.grad = grad.to(full.dtype)
            self._full[i] = None
