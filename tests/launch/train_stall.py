"""A tiny training script that stalls on purpose, for the stall-watch tests.

    lockstep run --nproc-per-node 2 --stall-timeout 5 tests/launch/train_stall.py \\
        --out /tmp/stall --hang-rank 1 --hang-step 3

`--hang-rank R --hang-step S`: rank R sleeps forever before step S (it writes
OUT/hang_started first); with `--freeze`, it stops itself with SIGSTOP instead.
`--short-rank R`: rank R gets one batch fewer, leaves the loop early and calls
Checkpointer.save while the others still train. `--save-step S`: every rank saves
a checkpoint after step S. Without these, every rank trains `--steps` steps with
lockstep's engine and exits 0. Every rank dies with its launcher (torchrun too).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import lockstep


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-step", type=int, default=-1)
    parser.add_argument("--short-rank", type=int, default=-1)
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument("--save-step", type=int, default=-1)
    return parser.parse_args()


def hang_here(out: Path, freeze: bool) -> None:
    (out / "hang_started").write_text(str(time.time()))
    if freeze:
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(1.0)


def main() -> None:
    args = parse_args()
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphans
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = lockstep.init()
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = args.steps - (ctx.rank == args.short_rank)
    for step in range(steps):
        if ctx.rank == args.hang_rank and step == args.hang_step:
            hang_here(out, args.freeze)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + ctx.rank))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if step == args.save_step:
            lockstep.Checkpointer(out / "ckpt").save(step, model=model, optimizer=optimizer)
    if args.short_rank >= 0:
        if ctx.rank == args.short_rank:
            (out / "hang_started").write_text(str(time.time()))
        lockstep.Checkpointer(out / "ckpt").save(steps, model=model, optimizer=optimizer)
    lockstep.shutdown()


if __name__ == "__main__":
    main()
