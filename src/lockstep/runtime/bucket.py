"""`Bucket`: one flat gradient buffer, the parameters that live in it, and its collective.

Each trainable parameter owns a slice of exactly one bucket. During backward
the reducer copies (or, with gradient_as_bucket_view, finds) each gradient in
its slice and counts down `pending`; when it reaches zero the bucket is
complete and its collective may start. How gradients are scaled on the way in
is the bucket's `averaging`, chosen once by the bucket collective
(`lockstep.runtime.bucket_collective`). `GradBucket` is the face a bucket shows to
communication hooks, with the methods of torch's `dist.GradBucket`, so torch's
own hooks run on this engine too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lockstep.runtime.averaging import Averaging
    from lockstep.runtime.handles import CollectiveHandle


@dataclass
class BucketTimes:
    """perf_counter() stamps of one bucket in the current step (0.0 = not yet)."""

    ready: float = 0.0
    launched: float = 0.0
    done: float = 0.0


@dataclass
class Bucket:
    """A flat buffer holding the gradients of `params`, in that order.

    The fields after `averaging` describe the current step only; `reset()` arms
    them for the next one.
    """

    index: int
    params: list[torch.nn.Parameter]
    param_indices: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    averaging: Averaging | None = None
    pending: int = 0
    handle: CollectiveHandle | None = None
    times: BucketTimes = field(default_factory=BucketTimes)
    # Gradients copied in already scaled, and slots whose gradient was found in place.
    scaled_copies: int = 0
    found_in_place: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        index: int,
        params: list[torch.nn.Parameter],
        param_indices: list[int],
        averaging: Averaging | None,
    ) -> Bucket:
        """Allocate a zeroed buffer for `params` and one view per parameter, shaped like it."""
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for param in params:
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return cls(index, params, param_indices, buffer, views, averaging, len(params))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        """Arm the bucket for the next synchronised backward."""
        self.pending = len(self.params)
        self.handle = None
        self.times = BucketTimes()
        self.scaled_copies = 0
        self.found_in_place = []

    def copy_in(self, view: torch.Tensor, grad: torch.Tensor) -> None:
        """Copy `grad` into its slot `view`, scaled by 1/N on the way when the engine averages.

        One pass over the bytes, as torch DDP does for copied gradients.
        """
        if self.averaging is None:
            view.copy_(grad)
        elif self.averaging.copies_divided:
            view.copy_(grad)
            self.found_in_place.append(view)
        else:
            torch.mul(grad, self.averaging.multiplier, out=view)
            self.scaled_copies += 1

    def found(self, view: torch.Tensor) -> None:
        """Note a gradient that autograd left in its slot already (a bucket view)."""
        if self.averaging is not None:
            self.found_in_place.append(view)

    def divide_found_in_place(self) -> None:
        """Divide by N the gradients found in place, before the sum.

        Torch DDP divides each such gradient in its hook; here it waits until the
        bucket is complete. When no gradient of the bucket was copied in (already
        scaled), one division over the flat buffer does it: one kernel instead of
        one per gradient, the same bits, and zero-filled slots stay zero.
        """
        if not self.found_in_place:
            return
        assert self.averaging is not None
        if self.scaled_copies == 0:
            self.buffer.div_(self.averaging.divisor)
        else:
            for view in self.found_in_place:
                view.div_(self.averaging.divisor)


class GradBucket:
    """The bucket as a communication hook sees it (torch's `dist.GradBucket` methods).

    `set_buffer` replaces the tensor that `buffer()` and `gradients()` return, as
    torch's does: `fp16_compress_wrapper` swaps in a float16 copy, so the hook it
    wraps divides and reduces in float16. The bucket's own buffer is untouched
    until the hook's result is copied into it (`runtime/handles.py`, `HookHandle`).

    Args:
        bucket: the engine's bucket.
        is_last: whether this is the last bucket of the step.
    """

    def __init__(self, bucket: Bucket, is_last: bool) -> None:
        self._bucket = bucket
        self._is_last = is_last
        self._buffer = bucket.buffer

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat buffer of the bucket's gradients (already averaged by nobody)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views of `buffer()`, shaped like the parameters."""
        if self._buffer is self._bucket.buffer:
            return list(self._bucket.views)
        views, offset = [], 0
        for param in self._bucket.params:
            views.append(self._buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return views

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make `tensor` (same number of elements, any dtype) the buffer the hook sees."""
        if tensor.numel() != self._bucket.buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer expected a tensor of {self._bucket.buffer.numel()} "
                f"elements (bucket {self._bucket.index}); found {tensor.numel()}. Pass the "
                "bucket's buffer cast or compressed elementwise, e.g. buffer().to(torch.float16)."
            )
        self._buffer = tensor.view(-1)

    def is_the_last_bucket_to_allreduce(self) -> bool:
        return self._is_last
