"""A tiny, deterministic training script for the launcher tests; resumes from its checkpoint.

    lockstep run --nproc-per-node 2 tests/launch/train_tiny.py --out /tmp/run --steps 6

Every step draws the global batch from a generator seeded by the step number and
gives rank r its slice, so the data order depends only on (step, rank, world
size), never on restarts. A checkpoint is written after every step; on start the
script resumes from the latest one. Rank 0 writes the final parameters to
OUT/final.pt. `--kill-rank R --kill-step S` makes rank R SIGKILL itself before step
S of the first attempt; `--raise-rank R` makes rank R raise instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
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
    parser.add_argument("--step-sleep", type=float, default=0.0)
    return parser.parse_args()


class Checkpoints:
    """lockstep.Checkpointer when it exists; otherwise one file per step written by rank 0."""

    def __init__(self, directory: Path, ctx: lockstep.DistContext) -> None:
        self.ctx = ctx
        self.directory = directory
        checkpointer = getattr(lockstep, "Checkpointer", None)
        self.checkpointer = checkpointer(directory, keep=3) if checkpointer else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save(step, model=model, optimizer=optimizer)
        elif self.ctx.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f"step{step}.tmp"
            state = {"step": step, "model": model.state_dict(), "opt": optimizer.state_dict()}
            torch.save(state, tmp)
            tmp.rename(self.directory / f"step{step}.pt")
        dist.barrier()

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
        if self.checkpointer is not None:
            return self.checkpointer.restore(model=model, optimizer=optimizer)
        files = sorted(self.directory.glob("step*.pt"), key=lambda p: int(p.stem[4:]))
        if not files:
            return None
        state = torch.load(files[-1], weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["opt"])
        return state["step"]


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH * world_size, FEATURES, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    rows = slice(rank * GLOBAL_BATCH, (rank + 1) * GLOBAL_BATCH)
    return x[rows], y[rows]


def main() -> None:
    args = parse_args()
    ctx = lockstep.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = lockstep.NaiveDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoints = Checkpoints(Path(args.out) / "ckpt", ctx)
    last = checkpoints.restore(model, optimizer)
    start = 0 if last is None else last + 1
    print(f"rank {ctx.rank} restart {ctx.restart_count} starts at step {start}", flush=True)
    for step in range(start, args.steps):
        if ctx.restart_count == 0 and step == args.kill_step and ctx.rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.rank == args.raise_rank:
            raise RuntimeError(f"planned failure on rank {ctx.rank} at step {step}")
        x, y = batch(step, ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp.sync_gradients()
        optimizer.step()
        checkpoints.save(step, model, optimizer)
        time.sleep(args.step_sleep)
    if ctx.is_main:
        torch.save(
            {k: v.clone() for k, v in model.state_dict().items()}, Path(args.out) / "final.pt"
        )
        (Path(args.out) / "restarts.txt").write_text(str(ctx.restart_count))
    lockstep.shutdown()


if __name__ == "__main__":
    main()
