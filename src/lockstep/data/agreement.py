"""Pre-flight agreement check: before the first batch, every rank must describe the same data.

Each rank states a few integers (dataset length, shuffle seed, batches per
epoch); the statements are gathered so every rank sees all of them and raises
the same error when they differ. Without this check, ranks with different
lengths or batch counts would reach the gradient all-reduce a different number
of times and one of them would hang there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from lockstep.collectives.agreement import gather_from_ranks
from lockstep.errors import RankMismatchError


def gather_statements(
    statement: dict[str, int | None], process_group: dist.ProcessGroup | None = None
) -> list[dict[str, int | None]]:
    """Every rank's `statement`, indexed by rank (the same list on every rank)."""
    gathered = gather_from_ranks(statement, process_group)
    return [dict(s or {}) for s in gathered]


def disagreements(statements: list[dict[str, int | None]]) -> list[str]:
    """One line per field on which the ranks differ, naming every rank's value."""
    lines = []
    for field in statements[0]:
        values = [s.get(field) for s in statements]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"rank {r} has {v}" for r, v in enumerate(values))
            lines.append(f"{field}: {by_rank}")
    return lines


def check_data_agreement(
    statement: dict[str, int | None],
    process_group: dist.ProcessGroup | None = None,
    *,
    shared: dict[str, int | None] | None = None,
    gather: Callable[[dict[str, int | None]], list[dict[str, int | None]]] | None = None,
) -> list[dict[str, int | None]]:
    """Gather `statement` from every rank and raise on every rank if any field differs.

    Args:
        statement: field name -> value on this rank, compared across ranks, for example
            {"dataset length": 1797, "seed": 0, "batches per epoch": 29}.
        process_group: the ranks that must agree; the default group when None.
        shared: further fields that are gathered but not compared (such as a random seed
            that every rank then takes from rank 0).
        gather: how the statements are gathered (live recovery's interruptible gather,
            `live/agreement.py`); `gather_statements` over `process_group` if None.

    Returns:
        Every rank's statement and shared fields together, indexed by rank.

    Raises:
        RankMismatchError: the ranks differ; the message names each field, rank and value.
    """
    mine = {**(shared or {}), **statement}
    statements = gather(mine) if gather else gather_statements(mine, process_group)
    lines = disagreements([{k: s[k] for k in statement} for s in statements])
    if lines:
        raise RankMismatchError(
            "ranks disagree about their data at the first iteration (seen on rank "
            f"{dist.get_rank()}): " + "; ".join(lines) + ". Expected every rank to build the "
            "same dataset and pass the same seed and batch size to the sampler (a seed that "
            "includes the rank, or a dataset read from a rank-local file, are common causes); "
            "make them the same on every rank."
        )
    return statements
