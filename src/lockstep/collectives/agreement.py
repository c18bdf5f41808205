"""Gather-and-compare: what every agreement check across ranks does first.

Each rank states something (its parameters, its arguments, its data, the
algorithm it asked for); `gather_from_ranks` hands every rank the list of all
statements, indexed by group rank, so every rank sees the same list and raises
the same error; `differing_ranks` names the ranks whose statement differs from
rank 0's. The checks themselves word their errors (`runtime/same_parameters.py`,
`sharded/arguments.py`, `data/agreement.py`, `collectives/registry.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def gather_from_ranks(statement: T, process_group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's `statement` (any picklable object), indexed by rank in `process_group`.

    A collective: every rank of the group must call it. One rank alone gets [statement].
    """
    if not dist.is_initialized():
        return [statement]
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, statement, group=process_group)
    return gathered


def differing_ranks(statements: list[T], same: Callable[[T, T], bool] | None = None) -> list[int]:
    """The ranks whose statement differs from rank 0's (by `same`, or ==), in rank order."""
    reference = statements[0]
    equal = same or (lambda a, b: a == b)
    return [rank for rank, s in enumerate(statements) if not equal(reference, s)]
