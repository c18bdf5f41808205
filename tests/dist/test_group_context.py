"""`group_context` trusts a process group made by hand over partial launcher variables.

torch's own test harness (and many scripts) call `init_process_group(rank=...,
world_size=...)` themselves and leave only WORLD_SIZE set. The wrapper must then
take rank and world size from the group, and train as torch's DDP does, rather
than fail asking for RANK. Oracle: torch's DDP in the same ranks, bitwise.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import lockstep
from lockstep.context import group_context
from lockstep.testing import run_ranks


def _without_rank(ctx: lockstep.DistContext) -> dict:
    os.environ.pop("RANK")  # WORLD_SIZE stays, as torch's harness leaves it
    found = group_context()
    grads = {}
    for cls in (lockstep.DistributedDataParallel, nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        ddp = cls(nn.Linear(4, 2))
        ddp(torch.full((3, 4), float(ctx.rank + 1))).sum().backward()
        grads[cls.__module__] = [p.grad.clone() for p in ddp.parameters()]
    return {"rank": found.rank, "world_size": found.world_size, "grads": grads}


def test_partial_launcher_variables_defer_to_the_group() -> None:
    results = run_ranks(_without_rank, 2, deadline_s=120)
    for rank, result in enumerate(results):
        assert (result["rank"], result["world_size"]) == (rank, 2)
        ours, torchs = result["grads"].values()
        for a, b in zip(ours, torchs, strict=True):
            assert torch.equal(a, b)
