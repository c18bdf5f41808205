"""The step benchmarks/live_cost.py times, with and without `--live-recovery` (not run by hand).

    lockstep run --nproc-per-node 2 [--live-recovery] benchmarks/live_cost_worker.py \\
        --width 1024 --layers 4 --steps 30 --out FILE

lockstep's DDP engine over `--layers` Linear(width, width) + Tanh (`--batchnorm`: a
BatchNorm1d after each Linear, whose buffers DDP broadcasts at each forward), SGD, a
Checkpointer restored at the start (what live recovery asks of a script; no
checkpoint exists, none is saved). Rank 0 writes each step's seconds to FILE (JSON).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import lockstep

BATCH = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batchnorm", action="store_true")
    args = parser.parse_args()
    ctx = lockstep.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        norm = nn.BatchNorm1d(args.width) if args.batchnorm else nn.Identity()
        layers += [nn.Linear(args.width, args.width), norm, nn.Tanh()]
    ddp = lockstep.DistributedDataParallel(nn.Sequential(*layers))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as empty:
        lockstep.Checkpointer(Path(empty) / f"rank{ctx.rank}").restore(
            model=ddp, optimizer=optimizer
        )
    x = torch.randn(BATCH, args.width)
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    if ctx.rank == 0:
        params = sum(p.numel() for p in ddp.parameters())
        buffers = sum(b.numel() * b.element_size() for b in ddp.buffers())
        found = {"seconds": seconds, "params": params, "buffer_bytes": buffers}
        Path(args.out).write_text(json.dumps(found))
    lockstep.shutdown()


if __name__ == "__main__":
    main()
