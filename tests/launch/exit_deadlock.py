"""The exit deadlock, made certain: torch's Reducer frees the group while gloo retires a work.

    lockstep run --nproc-per-node 2 tests/launch/exit_deadlock.py
    torchrun --nproc-per-node 2 tests/launch/exit_deadlock.py --lockstep

Rank 0 starts an all-reduce that rank 1 joins only 1 s later; the work carries a
Python object (a torch function mode is active), so the gloo thread retiring it takes
the GIL. Rank 0 then drops its handle, destroys the group and frees a torch DDP module:
if its C++ Reducer holds the last reference, the group's destructor joins the gloo
thread with the GIL held, and the process never exits. Prints "freed" when past it.
"""

from __future__ import annotations

import os
import sys
import time

if "--lockstep" in sys.argv:
    import lockstep  # noqa: F401

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode


class PassThrough(TorchFunctionMode):
    """A mode that changes nothing; while active, every new work's state holds it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main() -> None:
    dist.init_process_group("gloo")
    model = DistributedDataParallel(nn.Linear(4, 4))
    payload = torch.ones(1 << 16)
    if dist.get_rank() == 1:
        time.sleep(1.0)
    with PassThrough():
        work = dist.all_reduce(payload, async_op=True)
    if dist.get_rank() == 0:
        del work  # the gloo thread holds the last reference to the work
    else:
        work.wait()
    dist.destroy_process_group()
    del model  # torch's Reducer drops its reference to the group here
    print(f"rank {os.environ['RANK']}: freed", flush=True)


if __name__ == "__main__":
    main()
