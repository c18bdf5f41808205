"""A training script for the replica check's launcher tests: one bit flipped on one rank.

    lockstep run --nproc-per-node 3 --live-recovery tests/launch/train_replicas.py \\
        --out /tmp/r --flip 1:3

DDP, Adam, dropout (each rank its own stream), tiny buckets, a checkpoint every
`--save-every` steps; every step's global batch depends only on the step number.
`--flip RANK:STEP` makes rank RANK flip one bit of one weight (through the weight's
int32 view, as a memory fault would) after its optimizer's step STEP, in its first
process only (never in a replacement or a restarted process). Each rank writes
OUT/final_rank<R>.pt (parameters and optimizer state) and OUT/pids/<rank>.<generation>.<restart>.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

import lockstep

FEATURES, BATCH = 6, 8


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * world_size, FEATURES, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[rows], y[rows]


def flip_bit(tensor: torch.Tensor, element: int = 5, bit: int = 22) -> None:
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[element] ^= 1 << bit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--flip", default="")
    args = parser.parse_args()
    out = Path(args.out)
    ctx = lockstep.init()
    generation = int(os.environ.get("LOCKSTEP_LIVE_GENERATION", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh()
    )
    model.append(nn.Linear(32, 1))
    torch.manual_seed(100 + ctx.rank)  # each rank its own dropout stream
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    checkpoints = lockstep.Checkpointer(out / "ckpt", keep=10)
    last = checkpoints.restore(model=ddp, optimizer=optimizer)
    start = 0 if last is None else last + 1
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"{ctx.rank}.{generation}.{ctx.restart_count}").write_text(str(os.getpid()))
    print(f"rank {ctx.rank} generation {generation} starts at step {start}", flush=True)
    flip_rank, _, flip_step = args.flip.partition(":")
    first_process = generation == 0 and ctx.restart_count == 0
    flips = first_process and args.flip != "" and int(flip_rank) == ctx.rank
    for step in range(start, args.steps):
        x, y = batch(step, ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        if flips and step == int(flip_step):
            flip_bit(model[3].weight)
            print(f"rank {ctx.rank} flipped a bit of 3.weight after step {step}", flush=True)
        if (step + 1) % args.save_every == 0:
            checkpoints.save(step, model=ddp, optimizer=optimizer)
        print(f"rank {ctx.rank} finished step {step}", flush=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, out / f"final_rank{ctx.rank}.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
