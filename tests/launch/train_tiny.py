"""A tiny, deterministic training script for the launcher tests; resumes from its checkpoint.

    lockstep run --nproc-per-node 2 tests/launch/train_tiny.py --out /tmp/run --steps 6

Every step draws the global batch from a generator seeded by the step number and
gives rank r its slice, so the data order depends only on (step, rank, world
size), never on restarts. A checkpoint (lockstep.Checkpointer) is written after
every step; on start the script resumes from the latest one. Rank 0 writes the
final parameters to OUT/final.pt. Each worker writes its pid to OUT/pids/.
`--kill-rank R --kill-step S` makes rank R SIGKILL itself before step S of the
first attempt; `--raise-rank R` makes rank R raise at its first step, every attempt;
`--late-rank R --late-s S` makes rank R sleep S seconds before `lockstep.init()`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import lockstep

GLOBAL_BATCH = 8
FEATURES = 6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--exit-rank", type=int, default=-1)  # sys.exit(0) at --exit-step
    parser.add_argument("--exit-step", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--late-rank", type=int, default=-1)
    parser.add_argument("--late-s", type=float, default=0.0)
    return parser.parse_args()


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH * world_size, FEATURES, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    rows = slice(rank * GLOBAL_BATCH, (rank + 1) * GLOBAL_BATCH)
    return x[rows], y[rows]


def main() -> None:
    args = parse_args()
    if int(os.environ.get("RANK", "0")) == args.late_rank:
        time.sleep(args.late_s)  # busy before it joins: its peers wait in the join
    ctx = lockstep.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = lockstep.NaiveDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoints = lockstep.Checkpointer(Path(args.out) / "ckpt", keep=2)
    last = checkpoints.restore(model=model, optimizer=optimizer)
    start = 0 if last is None else last + 1
    pids = Path(args.out) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"{ctx.rank}.{ctx.restart_count}").write_text(str(os.getpid()))
    print(f"rank {ctx.rank} restart {ctx.restart_count} starts at step {start}", flush=True)
    for step in range(start, args.steps):
        if ctx.restart_count == 0 and step == args.kill_step and ctx.rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.restart_count == 0 and step == args.exit_step and ctx.rank == args.exit_rank:
            sys.exit(0)  # leaves early, cleanly: its peers wait for it in the next collective
        if ctx.rank == args.raise_rank:
            raise RuntimeError(
                f"planned failure on rank {ctx.rank} at step {step} (restart {ctx.restart_count})"
            )
        x, y = batch(step, ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp.sync_gradients()
        optimizer.step()
        checkpoints.save(step, model=model, optimizer=optimizer)
        time.sleep(args.step_sleep)
    if ctx.is_main:
        torch.save(
            {k: v.clone() for k, v in model.state_dict().items()}, Path(args.out) / "final.pt"
        )
        (Path(args.out) / "restarts.txt").write_text(str(ctx.restart_count))
    lockstep.shutdown()


if __name__ == "__main__":
    main()
