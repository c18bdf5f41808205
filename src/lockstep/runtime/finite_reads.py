"""Where the non-finite check reads each gradient: in its hook while it is still in cache.

The check (`runtime/finite.py`) sums every gradient of a step. Summed with its
bucket just before the bucket's collective, a large gradient is read back from
memory long after autograd wrote it (a 25 MiB bucket has left the caches by then),
and the read delays the launch. So a slot of at least `HOT_BYTES` is summed by the
engine's hook right after the gradient reached it (the copy has just written it),
and only the small slots, where one op's fixed cost would outweigh its bytes, are
summed at the launch, one sum per run of neighbouring small slots. `plan` is a pure
function of a bucket's slot sizes; `BucketReads` holds one bucket's plan and views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Slots of this size and more are summed in their hook (`benchmarks/finite_ops.py`).
HOT_BYTES = 256 * 1024


@dataclass(frozen=True)
class ReadPlan:
    """One bucket's reads.

    Attributes:
        in_hook: positions (in the bucket's `views`) of the slots summed in their hook.
        runs: (start, end) element offsets in the flat buffer, summed at the launch: the
            small slots between the others.
    """

    in_hook: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]


def plan(sizes: Sequence[int], element_size: int, hot_bytes: int = HOT_BYTES) -> ReadPlan:
    """The reads of a bucket whose slots hold `sizes` elements each, in buffer order."""
    in_hook: list[int] = []
    runs: list[tuple[int, int]] = []
    start: int | None = None
    offset = 0
    for position, numel in enumerate(sizes):
        if numel * element_size >= hot_bytes:
            in_hook.append(position)
            if start is not None and offset > start:
                runs.append((start, offset))
            start = None
        elif start is None:
            start = offset
        offset += numel
    if start is not None and offset > start:
        runs.append((start, offset))
    return ReadPlan(tuple(in_hook), tuple(runs))


class BucketReads:
    """A bucket's plan, bound to its buffer: the runs as views, the count of hook reads.

    Args:
        buffer: the bucket's flat buffer.
        sizes: its slots' element counts, in buffer order.
        hot_bytes: the smallest slot summed in its hook.
    """

    def __init__(self, buffer: torch.Tensor, sizes: Sequence[int], hot_bytes: int) -> None:
        self.buffer = buffer
        self.plan = plan(sizes, buffer.element_size(), hot_bytes)
        self.runs = [buffer[start:end] for start, end in self.plan.runs]

    @property
    def in_hook(self) -> int:
        """How many slots a complete step sums in their hook."""
        return len(self.plan.in_hook)

    def covers(self, buffer: torch.Tensor, hook_reads: int) -> bool:
        """Whether the hook reads and the runs cover `buffer` this step: it is this plan's
        buffer and every slot planned for a hook was read there (else: read it all)."""
        return buffer is self.buffer and hook_reads == self.in_hook
