"""An interval's losses averaged over ranks, step by step, in one small all-reduce.

`Monitor.flush` calls this at the end of each logging interval. Each rank sends,
for each step of the interval, its loss and a count (1, or 0 for a step it has no
loss for); a step's mean is over the ranks that had it. Steps are placed by their
distance from the interval's last step, so a rank that joined inside the interval
(a live replacement, docs/multinode.md) sends fewer steps in the same message. One
more slot carries the last step's number: ranks that count steps differently raise
on every rank rather than averaging different steps together. A rank lost during
the all-reduce is a recovery point (`runtime/recovery.py`); that interval's
losses are then this rank's own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import RankMismatchError
from lockstep.runtime import recovery


def mean_over_ranks(
    steps: list[int],
    losses: list[Any],
    slots: int,
    group: dist.ProcessGroup | None,
    world_size: int,
    device: torch.device,
) -> list[float | None]:
    """Each step's loss averaged over the ranks that had one (None where none did).

    Args:
        steps: the interval's step numbers on this rank, in order, at most `slots`.
        losses: this rank's loss at each step: a scalar tensor, a number or None.
        slots: the most steps an interval holds on any rank (the Monitor's `log_every`).
        group: the model's group; world_size: its size; device: where the message lives.

    Raises:
        RankMismatchError: on every rank, when the ranks' last steps differ.
    """
    present = [(steps[-1] - s, x) for s, x in zip(steps, losses, strict=True) if x is not None]
    table = torch.zeros(2, slots + 1, dtype=torch.float64, device=device)
    if present:
        index = torch.tensor([slot for slot, _ in present], device=device)
        values = [torch.as_tensor(x, device=device).detach().reshape(()) for _, x in present]
        table[0, index] = torch.stack(values).to(torch.float64)  # no host sync yet
        table[1, index] = 1.0
    table[:, slots] = torch.tensor([float(steps[-1]), 1.0], dtype=torch.float64)
    everyone = (
        world_size > 1
        and recovery.run(
            recovery.Point.LOSS_MEAN,
            steps[-1],
            lambda: dist.all_reduce(table, group=group, async_op=True),
            group=group,
        ).ran
    )  # False: a rank was lost in it and recovered live; this rank's own losses then
    sums, counts = table.tolist()
    if everyone and sums[slots] != world_size * steps[-1]:
        raise RankMismatchError(
            f"Monitor: the ranks' step counts differ at a log interval (rank "
            f"{dist.get_rank(group) if world_size > 1 else 0} is at step {steps[-1]}, the "
            f"ranks' mean is {sums[slots] / world_size:g}). Expected every rank to call "
            "Monitor.step() once per step and to pass the same start_step (after a "
            "resume or in a live replacement: the step restore() returned, plus 1)."
        )
    means = [s / c if c else math.nan for s, c in zip(sums, counts, strict=True)]
    return [None if math.isnan(means[steps[-1] - s]) else means[steps[-1] - s] for s in steps]
