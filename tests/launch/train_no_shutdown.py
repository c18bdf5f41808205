"""A script that trains with every engine thread in use and never calls lockstep.shutdown().

    torchrun --nproc-per-node 2 tests/launch/train_no_shutdown.py

One model synchronises over the ring all-reduce (the communication thread), a
second through the PowerSGD hook (its thread pool); each takes 3 steps with the
step fingerprint and the stall inspector running. The script then simply ends:
the process must exit 0, with no abort during interpreter shutdown.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep
from lockstep.engine.powersgd import PowerSGDState, powersgd_hook


def train(model: nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def main() -> None:
    lockstep.init()
    torch.manual_seed(0)
    ring = lockstep.DistributedDataParallel(nn.Linear(16, 16), allreduce="ring")
    compressed = lockstep.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    )
    compressed.register_comm_hook(PowerSGDState(start_iter=1, process_group=None), powersgd_hook)
    train(ring, 3)
    train(compressed, 3)


if __name__ == "__main__":
    main()
