"""Refuse a model on the meta device at wrap time, on every rank, saying what to do.

A meta tensor has a shape and no values: there is nothing to check, broadcast or
train. FSDP2 lets a model be wrapped on meta and materialised after (`to_empty`,
then `reset_parameters`); lockstep's wrappers broadcast rank 0's values when they
wrap, so they need the values first. The ranks agree (one all-reduce) before any
raises: a model on meta on some ranks only fails on all of them, none waits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import LockstepError
from lockstep.runtime.recovery import replacing


class MetaDeviceError(LockstepError, ValueError):
    """The model has parameters or buffers on the meta device (raised on every rank)."""


def refuse_meta(module: nn.Module, process_group: dist.ProcessGroup | None, wrapper: str) -> None:
    """Raise on every rank if any rank's `module` holds a tensor on the meta device.

    Raises:
        MetaDeviceError: naming the ranks, a tensor and the way to materialise the model.
    """
    named = [*module.named_parameters(), *module.named_buffers()]
    on_meta = [name for name, tensor in named if tensor.is_meta]
    grouped = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(process_group) if grouped else 1
    flags = torch.zeros(world)
    flags[dist.get_rank(process_group) if grouped else 0] = float(bool(on_meta))
    if grouped and world > 1 and not replacing():  # a live replacement: only its own check
        dist.all_reduce(flags, group=process_group)
    ranks = [str(r) for r, flag in enumerate(flags.tolist()) if flag]
    if not ranks:
        return
    example = f" (here: '{on_meta[0]}', {len(on_meta)} in all)" if on_meta else ""
    raise MetaDeviceError(
        f"{wrapper} expected a model with values; found parameters or buffers on the meta "
        f"device on rank(s) {', '.join(ranks)}{example}. A meta tensor has no values to "
        f"check, broadcast or train. What to do: materialise the model before wrapping it: "
        f"`model.to_empty(device=ctx.device)`, then initialise it on every rank "
        f"(`reset_parameters()` of each module under the same torch.manual_seed, or load "
        f"a checkpoint); wrapping then copies rank 0's values to every rank. Wrapping on "
        f"meta and calling to_empty after (FSDP2's order) is not supported (docs/porting.md)."
    )
