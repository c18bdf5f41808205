"""torch's `mp.spawn` of 2 gloo ranks that build torch's DDP; no lockstep in it.

    LOCKSTEP_ENGINE=lockstep python tests/frameworks/spawn_ranks.py PORT

Each rank is a fresh interpreter (the spawn start method, as Lightning's ddp_spawn
uses): it prints the class of its wrapper.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    print(f"rank {rank}: wrapper {type(model).__name__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]),), nprocs=2)
