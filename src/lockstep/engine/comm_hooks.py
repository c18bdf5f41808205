"""Communication hooks: what a bucket does instead of a plain all-reduce.

The contract is torch's: `hook(state, bucket) -> Future[Tensor]`, where the
bucket's `buffer()` holds the unscaled local gradients and the future's value
is the averaged buffer. Hooks here count the bytes they hand to collectives in
their `HookState`, so the engine can report what really went on the wire.
Register with `ddp.register_comm_hook(HookState(), fp16_compress_hook)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.runtime.bucket import GradBucket


@dataclass
class HookState:
    """A hook's process group and a count of the bytes it all-reduced this step."""

    process_group: dist.ProcessGroup | None = None
    sent_bytes: int = 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def take_sent_bytes(self) -> int:
        """Bytes handed to all-reduce since the last call (the engine calls it each step)."""
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start a SUM all-reduce of `tensor` in place, counting its bytes."""
        self.sent_bytes += tensor.numel() * tensor.element_size()
        return dist.all_reduce(tensor, group=self.process_group, async_op=True).get_future()


def allreduce_mean_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future:
    """The default behaviour as a hook: divide by the world size, then sum."""
    buffer = bucket.buffer().div_(state.world_size)
    return state.all_reduce(buffer).then(lambda fut: fut.value()[0])


def _compressing_hook(
    dtype: torch.dtype,
) -> Callable[[HookState, GradBucket], torch.futures.Future]:
    def hook(state: HookState, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(state.world_size)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        return state.all_reduce(compressed).then(decompress)

    return hook


fp16_compress_hook = _compressing_hook(torch.float16)
fp16_compress_hook.__doc__ = "Cast the bucket to float16, average, cast back: half the bytes."
bf16_compress_hook = _compressing_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = "Cast the bucket to bfloat16, average, cast back: half the bytes."


# torch refuses its own bfloat16 hooks by name unless its build has bf16 collectives.
_BF16_HOOKS = ("bf16_compress_hook", "bf16_compress_wrapper_hook")


def _bf16_collectives_built() -> bool:
    """torch's condition: a CUDA (or ROCm) build with NCCL 2.10+, or XPU with XCCL."""
    cuda = bool(torch.version.cuda or torch.version.hip) and dist.is_nccl_available()
    if cuda and torch.cuda.nccl.version() >= (2, 10):
        return True
    xccl = getattr(dist, "is_xccl_available", None)
    return bool(xccl is not None and xccl() and torch.xpu.is_available())


def check_comm_hook(hook: object, rank: int) -> None:
    """Refuse what torch's `register_comm_hook` refuses, with torch's exception types.

    Raises:
        TypeError: `hook` is not callable; torch's bf16 hook (or wrapper) on a torch
            build without bfloat16 collectives (a CPU build: gloo), as torch raises.
    """
    if not callable(hook):
        raise TypeError(
            f"Communication hook must be callable; found {type(hook).__name__} (rank {rank}). "
            "Pass a function hook(state, bucket) -> torch.futures.Future[torch.Tensor]."
        )
    name = getattr(hook, "__name__", "")
    if name in _BF16_HOOKS and not _bf16_collectives_built():
        raise TypeError(
            f"{name} needs bfloat16 collectives, which torch's DistributedDataParallel "
            "accepts only with CUDA 11+ and NCCL 2.10+ (or XPU and XCCL); this torch build "
            f"has neither (rank {rank}). Expected fp16_compress_hook (or fp16_compress_wrapper) "
            "here, or a CUDA build of torch with NCCL for bf16."
        )
