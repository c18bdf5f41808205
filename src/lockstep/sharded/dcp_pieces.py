"""A flat shard's piece of one tensor, as torch's distributed checkpoint (DCP) sees it.

DCP names each saved piece of a tensor by a rectangle (offsets and sizes per dim,
`ChunkStorageMetadata`) and, on load, reads into every local rectangle whatever
saved rectangles overlap it, whoever wrote them. A rank's piece of a parameter is
a contiguous range of the flattened parameter, so `FlatPiece` offers it as the
rectangles of `boxes.py`, each a view of the shard: DCP writes them from the
shard and reads into it in place. It follows DCP's `_Checkpointable` protocol;
the two planners below look such pieces up by offset (torch's look-up takes only
tensors). DTensor and ShardedTensor are the other two implementations in torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lockstep.sharded.boxes import Box, range_boxes
from lockstep.sharded.flat import FlatParam


class FlatPiece:
    """This rank's elements of a tensor of shape `shape`, as views of a flat buffer.

    Args:
        shape: the whole tensor's shape (a parameter's, or its optimizer state's).
        boxes: the rectangles this rank holds (none when its shard misses the tensor).
        views: one view per box, shaped like it, into the rank's flat buffer.
        dtype: the dtype of the buffer.
    """

    def __init__(
        self, shape: torch.Size, boxes: list[Box], views: list[torch.Tensor], dtype: torch.dtype
    ) -> None:
        self.shape, self.boxes, self.views, self.dtype = shape, boxes, views, dtype
        self._by_offset = {box.offsets: view for box, view in zip(boxes, views, strict=True)}

    def size(self) -> torch.Size:
        """The whole tensor's shape (what DCP compares with the saved size)."""
        return self.shape

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, box.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(box), properties=props, size=torch.Size(self.shape)
                ),
            )
            for box in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(box) for box in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset or ())
        if offsets not in self._by_offset:
            raise ValueError(f"{index.fqn}: this rank holds no piece at offsets {offsets}")
        return self._by_offset[offsets]


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


def piece_of(flat: FlatParam, i: int, buffer: torch.Tensor) -> FlatPiece:
    """This rank's piece of parameter `i` of `flat`, read from a shard-shaped `buffer`.

    The rank is the one in the flat's own group (the group its shards are spread
    over), so ranks that hold the same shard write the same rectangles: DCP keeps one.

    Args:
        flat: the flat the parameter lies in.
        i: the parameter's index in the flat.
        buffer: a tensor of the shard's length: the shard itself, or optimizer state.
    """
    rank = dist.get_rank(flat.process_group)
    shape = flat.shapes[i]
    part = next((p for p in flat.layout.pieces(rank) if p.param == i), None)
    if part is None:
        return FlatPiece(shape, [], [], buffer.dtype)
    boxes = range_boxes(shape, part.param_offset, part.param_offset + part.numel)
    views = []
    for box in boxes:
        at = part.shard_offset + box.start - part.param_offset
        views.append(buffer.detach()[at : at + box.numel].view(box.sizes))
    return FlatPiece(shape, boxes, views, buffer.dtype)


def _find(state_dict: dict[str, Any], index: MetadataIndex) -> torch.Tensor | None:
    found = state_dict.get(index.fqn)
    return found.__get_tensor_shard__(index) if isinstance(found, FlatPiece) else None


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the rectangles of a `FlatPiece`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _find(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also reads into the rectangles of a `FlatPiece`.

    Torch's set-up replaces every value it does not know (meta-device handling) with
    None; the pieces are put back after it. Use with flatten_state_dict=False.
    """

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, FlatPiece)}
        super().set_up_planner(state_dict, *args, **kwargs)
        self.state_dict.update(pieces)
        state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _find(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found
