"""Pre-flight agreement check: before the first batch, every rank must describe the same data.

Each rank states a few integers (dataset length, shuffle seed, batches per
epoch); the statements are gathered so every rank sees all of them and raises
the same error when they differ. Without this check, ranks with different
lengths or batch counts would reach the gradient all-reduce a different number
of times and one of them would hang there.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.errors import RankMismatchError
from lockstep.runtime import recovery
from lockstep.runtime.control_device import control_device

Statement = dict[str, int | None]


def gather_statements(
    statement: Statement,
    process_group: dist.ProcessGroup | None = None,
    settle: Callable[[Statement], None] | None = None,
) -> list[Statement]:
    """Every rank's `statement`, indexed by rank (the same list on every rank).

    Two asynchronous all-gathers (the lengths, then the padded bytes), each a recovery
    point at the first step's start (`runtime/recovery.py`): after a loss met in them,
    only the statement this rank took from a peer's post, which `settle` (the seed's
    owner) was given before the state went over.
    """
    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return [statement]
    device = control_device(process_group)
    world = dist.get_world_size(process_group)
    mine = torch.frombuffer(bytearray(pickle.dumps(statement)), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    value = (statement, settle)
    outcome = recovery.run(
        recovery.Point.AGREEMENT,
        0,
        lambda: dist.all_gather(sizes, length, group=process_group, async_op=True),
        value=value,
        group=process_group,
    )
    if not outcome.ran:
        return outcome.value
    lengths = [int(n.item()) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    every = [torch.empty_like(padded) for _ in range(world)]
    outcome = recovery.run(
        recovery.Point.AGREEMENT,
        0,
        lambda: dist.all_gather(every, padded, group=process_group, async_op=True),
        value=value,
        group=process_group,
    )
    if not outcome.ran:
        return outcome.value
    return [
        pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(every, lengths, strict=True)
    ]


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
    settle: Callable[[Statement], None] | None = None,
) -> list[Statement]:
    """Gather `statement` from every rank and raise on every rank if any field differs.

    Args:
        statement: field name -> value on this rank, compared across ranks, for example
            {"dataset length": 1797, "seed": 0, "batches per epoch": 29}.
        process_group: the ranks that must agree; the default group when None.
        shared: further fields that are gathered but not compared (such as a random seed
            that every rank then takes from rank 0).
        settle: takes rank 0's statement (its shared fields); called here only after a
            live recovery in the gather, before the state goes over to the replacement.

    Returns:
        Every rank's statement and shared fields together, indexed by rank; after a live
        recovery in the gather, the one statement this rank took (a peer past the gather
        compared them; the step fingerprint still catches uneven data).

    Raises:
        RankMismatchError: the ranks differ; the message names each field, rank and value.
    """
    mine = {**(shared or {}), **statement}
    statements = gather_statements(mine, process_group, settle)
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
