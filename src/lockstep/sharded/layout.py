"""Where each parameter lives in a flat, padded buffer, and which slice each rank owns.

The sharded engine packs the parameters of one unit (a bucket for stages 1 and 2,
a wrapped module for stage 3) into one flat buffer, padded so that it splits
into `world_size` equal shards; rank r owns elements [r*S, (r+1)*S). This is a
pure function of the parameter sizes and the world size (no processes), so it
is unit-tested alone and used again to reshard a checkpoint at another size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """The part of parameter `param` that lies in one rank's shard.

    Attributes:
        param: index of the parameter in the unit.
        param_offset: first element of the piece inside the (flattened) parameter.
        shard_offset: first element of the piece inside the shard.
        numel: number of elements.
    """

    param: int
    param_offset: int
    shard_offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of the parameters in a flat buffer of `padded_numel` elements.

    Attributes:
        numels: element count of each parameter, in buffer order.
        offsets: first element of each parameter in the buffer.
        world_size: number of shards.
        shard_numel: elements per shard (S); padded_numel == world_size * S.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int
    shard_numel: int

    @property
    def numel(self) -> int:
        """Elements that hold parameters (without the padding)."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def split_sizes(self) -> list[int]:
        """Sizes that `torch.split` cuts the padded buffer into: each parameter, then padding."""
        return [*self.numels, self.padded_numel - self.numel]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard in the padded buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of parameters that rank `rank`'s shard holds, in buffer order."""
        start, end = self.shard_range(rank)
        out = []
        for i, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                out.append(Piece(i, lo - offset, lo - start, hi - lo))
        return out


def flat_layout(numels: Sequence[int], world_size: int) -> FlatLayout:
    """Lay out parameters of `numels` elements back to back, padded to `world_size` shards.

    Args:
        numels: element count of each parameter, in the order they are packed.
        world_size: number of ranks sharing the buffer.

    Returns:
        The layout; each shard has ceil(sum(numels) / world_size) elements.

    Raises:
        ValueError: world_size < 1, no parameters, or a negative element count.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1; found {world_size}")
    if not numels or any(n < 0 for n in numels):
        raise ValueError(f"expected one or more non-negative element counts; found {numels}")
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    shard = -(-total // world_size)
    return FlatLayout(tuple(numels), tuple(offsets), world_size, max(shard, 1))
