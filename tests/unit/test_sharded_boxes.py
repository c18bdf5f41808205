"""`range_boxes`: a contiguous range of a flattened tensor cut into rectangles DCP can name.

Every range of several shapes is checked element by element: the boxes are
disjoint, each is contiguous in the flattened order, and together they are
exactly the range; a range that is not a block of rows takes more than one box.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lockstep.sharded.boxes import range_boxes


def _elements(shape: tuple[int, ...], box) -> list[int]:
    """Flat indices of the elements inside `box` of a tensor of `shape`, in row-major order."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    for dim, (offset, size) in enumerate(zip(box.offsets, box.sizes, strict=True)):
        index = index.narrow(dim, offset, size)
    return index.reshape(-1).tolist()


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), ()])
def test_boxes_are_exactly_the_range(shape):
    numel = math.prod(shape)
    for start, end in itertools.combinations_with_replacement(range(numel + 1), 2):
        boxes = range_boxes(shape, start, end)
        covered: list[int] = []
        for box in boxes:
            inside = _elements(shape, box)
            assert inside == list(range(box.start, box.start + box.numel)), (shape, box)
            covered += inside
        assert covered == list(range(start, end)), (shape, start, end, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_a_range_across_rows_is_three_boxes():
    boxes = range_boxes((4, 5), 3, 17)
    assert [(b.offsets, b.sizes) for b in boxes] == [
        ((0, 3), (1, 2)),
        ((1, 0), (2, 5)),
        ((3, 0), (1, 2)),
    ]


def test_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="not inside"):
        range_boxes((2, 3), 4, 7)
