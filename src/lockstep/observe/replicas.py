"""Are the replicas still identical? A checksum of every parameter, compared across ranks.

Data-parallel training keeps one model per rank and promises they stay equal,
bit for bit. `check_replicas` hashes this rank's parameters and buffers (their
raw bytes, in state-dict order), all-gathers the digests and says whether every
rank holds the same one: the check to print at the end of a run, or after a resume.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lockstep.collectives.agreement import gather_from_ranks


def parameter_checksum(module: nn.Module) -> str:
    """SHA-256 of the module's state (names, dtypes, shapes and raw bytes), as hex."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        if not torch.is_tensor(tensor):
            continue
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class ReplicaCheck:
    """Every rank's checksum, in rank order."""

    checksums: tuple[str, ...]

    @property
    def identical(self) -> bool:
        return len(set(self.checksums)) == 1

    def describe(self) -> str:
        """One line: identical (with the digest's head) or which ranks differ from rank 0."""
        n = len(self.checksums)
        if self.identical:
            head = self.checksums[0][:16]
            return f"replicas identical: {n}/{n} ranks hold parameters sha256 {head}"
        differ = [r for r, c in enumerate(self.checksums) if c != self.checksums[0]]
        return f"replicas DIFFER: ranks {differ} hold other parameters than rank 0 ({n} ranks)"


def check_replicas(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> ReplicaCheck:
    """Checksum this rank's parameters and compare with every rank; call on every rank.

    Args:
        module: the model (wrapped or not: the wrapper's state dict has the same keys).
        process_group: the data-parallel group; the default group when None.

    Returns:
        Every rank's checksum (the same `ReplicaCheck` on every rank).
    """
    mine = parameter_checksum(module)
    if not (dist.is_available() and dist.is_initialized()):
        return ReplicaCheck((mine,))
    gathered = gather_from_ranks(mine, process_group)
    return ReplicaCheck(tuple(str(c) for c in gathered))
