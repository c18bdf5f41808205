"""Refuse a model wrapped twice in data-parallel wrappers, on every rank, naming both.

Two wrappers synchronise every gradient twice, and `no_sync()` on the outer one does
not reach the inner: results drift from the right ones with no error. Wrapping runs
on every rank, so `refuse_wrapped_inside` searches the module tree there (torch's DDP
or fully_shard, lockstep's engines, inside the module given). The other order, ours
inside torch's DDP, shows at the first forward: torch's DDP names itself in
`DistributedDataParallel._active_ddp_module` while it runs the module it wraps.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from lockstep.errors import LockstepError

# Classes matched by (module prefix, class name) along the MRO: no import of either side.
_WRAPPERS: dict[tuple[str, str], str] = {
    ("torch.nn.parallel", "DistributedDataParallel"): "torch.nn.parallel.DistributedDataParallel",
    ("torch.distributed.fsdp", "FullyShardedDataParallel"): "torch's FullyShardedDataParallel",
    ("torch.distributed.fsdp", "FSDPModule"): "torch's fully_shard",
    ("lockstep.", "DistributedDataParallel"): "lockstep.DistributedDataParallel",
    ("lockstep.", "ShardedDataParallel"): "lockstep.ShardedDataParallel",
    ("lockstep.", "NaiveDataParallel"): "lockstep.NaiveDataParallel",
}


class DoubleWrapError(LockstepError):
    """A model is wrapped in two data-parallel wrappers (raised on every rank)."""


def wrapper_name(module: nn.Module) -> str | None:
    """The data-parallel wrapper `module` is an instance of, in words; None for a plain one."""
    for cls in type(module).__mro__:
        for (prefix, name), words in _WRAPPERS.items():
            if cls.__name__ == name and cls.__module__.startswith(prefix):
                return words
    return None


def refuse_wrapped_inside(module: nn.Module, outer: str) -> None:
    """Raise if `module`, or a module inside it, is already a data-parallel wrapper.

    Raises:
        DoubleWrapError: naming both wrappers, where the inner one sits, and what to do.
    """
    for path, sub in module.named_modules():
        inner = wrapper_name(sub)
        if inner is not None:
            where = f"the module given (at '{path}')" if path else "the module given"
            _raise(outer, inner, where)


def refuse_inside_torch_ddp(inner: str) -> None:
    """Raise if this forward runs inside torch's DistributedDataParallel's forward.

    Raises:
        DoubleWrapError: naming both wrappers and what to do.
    """
    active = getattr(TorchDDP, "_active_ddp_module", None)
    if active is not None:
        _raise(wrapper_name(active) or type(active).__name__, inner, "its forward")


def _raise(outer: str, inner: str, where: str) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    raise DoubleWrapError(
        f"{outer} wraps {inner} ({where}), on rank {rank}: expected a model wrapped once "
        f"in one data-parallel wrapper. Two wrappers synchronise every gradient twice "
        f"and no_sync() on the outer one does not reach the inner one, so the results "
        f"would differ from the right ones without an error. What to do: wrap the plain "
        f"model once; pass `wrapped.module` instead of the wrapper, or, with a framework "
        f"that wraps the model itself (Accelerate's prepare, Lightning), give it the "
        f"plain model (docs/porting.md)."
    )
