"""Where the engine's small control tensors live: the device the group's backend reads.

Besides gradients, a step sends a few small tensors of its own: the step
fingerprint, the unused-parameter vote, the rebuilt bucket order. Gloo takes
CPU tensors; NCCL takes only CUDA tensors (its process group checks every
tensor). `control_device(group)` names the device such a tensor must be
made on for `group`; the engine creates them there and reads them back with
`.tolist()`, which waits for the device. `to_control_device` moves one made
on the host there without waiting (a plain `.to("cuda")` from pageable
memory synchronises the host with the stream).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device of control tensors sent over `group` (default group when None).

    NCCL: this process's current CUDA device; any other backend (gloo, or a group
    with a CPU backend beside NCCL): the CPU.
    """
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_control_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, with no host synchronisation.

    A CUDA copy goes through pinned memory and does not block; torch's caching host
    allocator keeps the pinned block until the copy has run.
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
