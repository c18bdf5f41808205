"""A script with no Checkpointer for the live-recovery tests: DDP and plain SGD, nothing else.

    lockstep run --nproc-per-node 2 --live-recovery tests/launch/train_live_plain.py --out /tmp/p

Its whole state is the weights and the step number, which is what a live replacement
of a script that never calls `Checkpointer.restore` receives: the loop starts at
`ddp.finished_steps` (0 at the start, the survivors' count in a replacement). The same
kills as `train_live.py` (LOCKSTEP_TEST_KILL), and LOCKSTEP_TEST_KILL_REPLACEMENT as
`train_live_faults.py`; OUT/final_rank<R>.pt and OUT/pids/ alike. `--torch` makes it a
torch script: it calls `torch.distributed.init_process_group` itself (not
`lockstep.init()`) and wraps with torch's `DistributedDataParallel`, which
`lockstep run --engine lockstep` turns into lockstep's engine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from train_live import FEATURES, arm_kill, batch, planned_kill
from train_live_faults import die, replacement_dies

import lockstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--torch", action="store_true", help="torch's init and DDP class")
    args = parser.parse_args()
    out = Path(args.out)
    generation = int(os.environ.get("LOCKSTEP_LIVE_GENERATION", "0"))
    if replacement_dies(int(os.environ["RANK"]), generation):
        die()  # before init(): it never joins its generation
    if args.torch:  # the script makes the group itself, as a plain torch script does
        dist.init_process_group("gloo")
    ctx = lockstep.init()  # with a group already made: describes it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    if args.torch:  # lockstep's engine under `--engine lockstep`
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0002)
    else:
        ddp = lockstep.DistributedDataParallel(
            model, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002
        )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"{ctx.rank}.{generation}.{ctx.restart_count}").write_text(str(os.getpid()))
    kill_step, where = planned_kill(ctx.rank, generation == 0 and ctx.restart_count == 0)
    armed = [False]
    arm_kill(model, optimizer, where, armed)
    for step in range(ddp.finished_steps, args.steps):
        armed[0] = step == kill_step
        x, y = batch(step, ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, out / f"final_rank{ctx.rank}.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
