"""`device_mesh(device)`: the mesh to hand torch's `fully_shard`, of the model's device type.

Without one, `fully_shard` builds a mesh of the accelerator's type: where CUDA is
visible a CPU model gets a CUDA mesh, and each rank calls `set_device(LOCAL_RANK)`,
which fails past the GPUs present ("invalid device ordinal"). Tests and benchmarks
that compare with FSDP2 pass this one-dimensional mesh over the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def device_mesh(device: str | torch.device) -> DeviceMesh:
    """A mesh of every rank of the default group, of `device`'s type ("cpu", "cuda")."""
    return init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
