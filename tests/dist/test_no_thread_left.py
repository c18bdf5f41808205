"""No lockstep thread outlives its wrapper or its process group (as Lightning's conftest checks).

Two gloo ranks start every thread lockstep has: the stall inspector (rank 1 starts
its backward late, so rank 0's waits are open when first polled), the worker of a
Python all-reduce (`allreduce="ring"`), PowerSGD's worker and the sharded engine's
ring reduce-scatter worker. Then the wrappers are
collected while their modules live on, as a LightningModule outlives the DDP wrapper
Lightning puts around it: no new thread may be left, and a backward through the bare
module runs no hook of the dead wrapper. Then the same with the group destroyed and
the wrappers still alive.
"""

from __future__ import annotations

import gc
import threading
import time

import torch
import torch.distributed as dist
from engine_models import MLP

import lockstep
from lockstep.engine.powersgd import PowerSGDState, powersgd_hook
from lockstep.testing import run_ranks


def _wrappers(ctx, nets: list[torch.nn.Module]) -> list[torch.nn.Module]:
    ring = lockstep.DistributedDataParallel(nets[0], allreduce="ring")
    powersgd = lockstep.DistributedDataParallel(nets[1])
    powersgd.register_comm_hook(PowerSGDState(rank=1, start_iter=0), powersgd_hook)
    sharded = lockstep.ShardedDataParallel(nets[2], stage=2)
    for model in (ring, powersgd, sharded):
        for step in range(2):
            loss = model(torch.randn(4, 8)).square().mean()
            if ctx.rank == 1 and step == 1:
                time.sleep(0.3)  # rank 0 waits on this step's collectives: its inspector runs
            loss.backward()
    return [ring, powersgd, sharded]


def _threads(ctx) -> dict[str, list[str]]:
    before = set(threading.enumerate())

    def new() -> list[str]:
        return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())

    torch.manual_seed(0)
    nets = [MLP(), MLP(), MLP()]
    out = {}
    models = _wrappers(ctx, nets)
    out["running"] = new()
    del models
    gc.collect()
    out["wrappers_collected"] = new()
    nets[0](torch.randn(4, 8)).sum().backward()  # the bare module: no hook of the dead wrapper
    models = _wrappers(ctx, [*nets[:2], MLP()])  # DDP's modules wrapped again
    out["running_again"] = new()
    dist.destroy_process_group()
    out["group_destroyed"] = new()
    del models  # alive until here: the group's end alone stopped the threads
    return out


def test_no_lockstep_thread_outlives_its_wrapper_or_its_group():
    per_rank = run_ranks(_threads, 2, deadline_s=90)
    running = per_rank[0]["running"]
    assert any(name.startswith("lockstep-stall") for name in running), running
    assert any(name.startswith("lockstep-comm") for name in running), running
    assert any(name.startswith("lockstep-powersgd") for name in running), running
    assert any(name.startswith("lockstep-scatter") for name in running), running
    for rank, out in enumerate(per_rank):
        assert out["wrappers_collected"] == [], f"rank {rank}: {out}"
        assert out["running_again"], f"rank {rank}: the threads did not start again: {out}"
        assert out["group_destroyed"] == [], f"rank {rank}: {out}"
