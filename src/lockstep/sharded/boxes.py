"""A contiguous range of a flattened tensor as rectangles of the tensor: pure, no processes.

A flat shard holds, of each parameter, the elements [start, end) of the parameter
flattened in row-major order: not a block of rows. Torch's distributed checkpoint
(DCP) describes a tensor's pieces as rectangles (offsets and sizes per dim), so a
range is cut into at most 2 * ndim - 1 of them: the end of the first partial row,
the full rows, the start of the last partial row, recursively in the lower dims.
Each rectangle is itself contiguous, so it is a view of the shard (`dcp_state.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A rectangle of a tensor that is also a contiguous run of its flattened elements.

    Attributes:
        offsets: first index of the rectangle in each dim.
        sizes: extent of the rectangle in each dim.
        start: position of its first element in the flattened tensor.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The rectangles that together are elements [start, end) of a tensor of `shape`.

    Args:
        shape: the tensor's shape (a 0-dim tensor has one element).
        start: first element of the range in the row-major flattened tensor.
        end: one past its last element.

    Returns:
        Disjoint boxes in flattened order, each contiguous; empty when start == end.

    Raises:
        ValueError: the range is not inside the tensor.
    """
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) is not inside a tensor of shape {tuple(shape)}")
    if start == end:
        return []
    return _boxes(tuple(shape), start, end)


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    if len(shape) <= 1:
        if not shape:
            return [Box((), (), 0)]
        return [Box((start,), (end - start,), start)]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:  # inside one row: the range of that row, one dim lower
        return [_within(shape, first, b) for b in _boxes(shape[1:], start % row, end - first * row)]
    out: list[Box] = []
    full_from, full_to = first, last + 1
    if start % row:
        out += [_within(shape, first, b) for b in _boxes(shape[1:], start % row, row)]
        full_from = first + 1
    if end % row:
        full_to = last
    if full_to > full_from:
        zeros = (0,) * (len(shape) - 1)
        out.append(Box((full_from, *zeros), (full_to - full_from, *shape[1:]), full_from * row))
    if end % row:
        out += [_within(shape, last, b) for b in _boxes(shape[1:], 0, end % row)]
    return out


def _within(shape: tuple[int, ...], row: int, box: Box) -> Box:
    """A box of row `row`'s sub-tensor, lifted into the whole tensor."""
    return Box((row, *box.offsets), (1, *box.sizes), row * math.prod(shape[1:]) + box.start)
