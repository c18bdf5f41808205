"""Make every replica start equal: broadcast parameters and buffers from rank 0.

Called once at wrap time by both engines (and before each forward for buffers
when the bucketed engine is asked to). Tensors are flattened per dtype and sent
in a few large broadcasts rather than one per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lockstep.runtime import waits

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], src: int, process_group: dist.ProcessGroup | None
) -> None:
    """Overwrite `tensors` on every rank with their values on global rank `src`, in place."""
    for chunk, flat in flattened(tensors):
        work = dist.broadcast(flat, src=src, group=process_group, async_op=True)
        waits.collective(work, "broadcast of the replicas' state", process_group)
        copy_back(chunk, flat)


def flattened(tensors: Iterable[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
    """`tensors` by dtype and device, in chunks of at most BROADCAST_CHUNK_BYTES, each
    chunk with a flat copy of its values (what one broadcast sends), made as it is
    reached: one chunk's copy at a time for a caller that sends each before the next."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        for chunk in _chunks(group):
            yield chunk, torch._utils._flatten_dense_tensors([t.detach() for t in chunk])


def copy_back(chunk: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write `flat`'s values into the tensors of `chunk` (the inverse of `flattened`)."""
    with torch.no_grad():
        for tensor, value in zip(
            chunk, torch._utils._unflatten_dense_tensors(flat, chunk), strict=True
        ):
            tensor.copy_(value)


def _chunks(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > BROADCAST_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(tensor)
        size += nbytes
    if chunk:
        yield chunk


def module_state(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `module`, each once (tied weights counted once)."""
    seen: set[int] = set()
    out = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


def broadcast_module(module: nn.Module, src: int, process_group: dist.ProcessGroup | None) -> None:
    """Copy global rank `src`'s parameters and buffers into every rank's `module`."""
    broadcast_tensors(module_state(module), src=src, process_group=process_group)
