"""The training script `benchmarks/recovery.py` kills and measures (not run by hand).

    lockstep run --nproc-per-node 2 [--live-recovery | --max-restarts 1] \\
        benchmarks/recovery_train.py --out DIR --steps 30 --save-every 10

lockstep's DDP engine, Adam, dropout (each rank its own stream), a checkpoint every
--save-every steps; each step's global batch depends only on the step number. After
every step each process appends `{"rank", "step", "t", "pid", "samples"}` to
DIR/events.jsonl (`samples`: the first and one past the last global sample id of the
rank's share of the step). RECOVERY_KILL="RANK:STEP" makes the first process of rank
RANK note the time in DIR/kill.json and SIGKILL itself inside backward of step STEP,
after its other buckets were launched; "RANK:STEP:hold" makes it write
DIR/kill_request instead and wait there to be killed from outside (with its whole
node, by benchmarks/recovery.py). At the end each rank writes DIR/final_rank<R>.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import lockstep

FEATURES, HIDDEN, BATCH = 32, 256, 64


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * world_size, FEATURES, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    return x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]


def build_model() -> nn.Sequential:
    """The benchmark's model, the same on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


def sample_ids(step: int, rank: int, world_size: int) -> list[int]:
    """[first, one past the last] global sample id of `rank`'s share of `step`'s batch."""
    first = (step * world_size + rank) * BATCH
    return [first, first + BATCH]


def arm_kill(model: nn.Sequential, out: Path, rank: int, first: bool) -> list[bool]:
    armed = [False]
    plan = os.environ.get("RECOVERY_KILL") or ""

    def die(grad: torch.Tensor) -> None:
        if armed[0] and plan.endswith(":hold"):
            (out / "kill_request").write_text(str(os.getpid()))
            time.sleep(600)  # killed from outside, with the rest of its node
        if armed[0]:
            (out / "kill.json").write_text(json.dumps({"rank": rank, "t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)

    if plan and first and int(plan.split(":")[0]) == rank:
        model[0].weight.register_hook(die)
        armed.append(True)
    return armed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    ctx = lockstep.init()
    first = os.environ.get("LOCKSTEP_LIVE_GENERATION", "0") == "0" and ctx.restart_count == 0
    model = build_model()
    torch.manual_seed(100 + ctx.rank)
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.1, first_bucket_cap_mb=0.1)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    checkpoints = lockstep.Checkpointer(out / "ckpt", keep=2)
    last = checkpoints.restore(model=ddp, optimizer=optimizer)
    armed = arm_kill(model, out, ctx.rank, first)
    kill_step = int((os.environ.get("RECOVERY_KILL") or "0:-1").split(":")[1])
    for step in range(0 if last is None else last + 1, args.steps):
        armed[0] = len(armed) > 1 and step == kill_step
        x, y = batch(step, ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        if (step + 1) % args.save_every == 0:
            checkpoints.save(step, model=ddp, optimizer=optimizer)
        event = {"rank": ctx.rank, "step": step, "t": time.time(), "pid": os.getpid()}
        event["samples"] = sample_ids(step, ctx.rank, ctx.world_size)
        with open(out / "events.jsonl", "a") as sink:
            sink.write(json.dumps(event) + "\n")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, out / f"final_rank{ctx.rank}.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
