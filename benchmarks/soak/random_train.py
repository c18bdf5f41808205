"""The random-fault soak's training script: a user's loop, with every piece of per-rank state.

    lockstep run --nproc-per-node 4 --live-recovery benchmarks/soak/random_train.py --out /tmp/r

Dropout with each rank's own random stream, AdamW, a OneCycleLR schedule, data dealt
by `lockstep.shard` over several epochs, a `Checkpointer` every 5 steps (`save(step)`
with the index of the step just finished, resumed at `restore() + 1`). At the end
every rank writes OUT/final/RANK.pt: parameters, optimizer, scheduler, its random
state and the sampler's epoch, so that the driver (benchmarks/soak/soak_one_node.py)
compares each rank with the same rank of an uninterrupted run.

For the driver, each process writes its pid to OUT/pids/RANK as it starts (before the
group forms, so a fault may land in the rendezvous too), appends "PID STEP EPOCH
ID,ID,..." to OUT/ids/RANK when it has drawn a step's batch, and "PID STEP TIME" to
OUT/steps/RANK when the step is done (a step done again logs again: its last line
counts). The script runs no collective of its own.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import lockstep

SAMPLES, BATCH, FEATURES, SAVE_EVERY = 64, 2, 8, 5  # 8 steps per epoch at 4 ranks


class Numbered(Dataset):
    """Sample i: (i, x, y), drawn from i alone."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(7000 + index))
        return index, x, x.sum(dim=0, keepdim=True).sin()


def append_line(path: Path, line: str) -> None:
    """One write per line, flushed: a kill never leaves half of one."""
    with open(path, "a") as log:
        log.write(line + "\n")


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    for folder in ("pids", "ids", "steps", "final"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    write_atomically(out / "pids" / str(rank), str(os.getpid()))
    ctx = lockstep.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))
    torch.manual_seed(100 + ctx.rank)  # each rank its own dropout stream
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.0002)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.05, total_steps=args.steps)
    loader = lockstep.shard(Numbered(), BATCH, seed=5)
    checkpoints = lockstep.Checkpointer(out / "ckpt", keep=2)
    state = {"model": ddp, "optimizer": optimizer, "scheduler": schedule, "sampler": loader}
    last = checkpoints.restore(**state)
    step = 0 if last is None else last + 1
    while step < args.steps:
        for ids, x, y in loader:
            drawn = f"{loader.sampler.epoch} {','.join(str(i) for i in ids.tolist())}"
            append_line(out / "ids" / str(ctx.rank), f"{os.getpid()} {step} {drawn}")
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            schedule.step()
            if (step + 1) % SAVE_EVERY == 0:
                checkpoints.save(step, **state)
            append_line(out / "steps" / str(ctx.rank), f"{os.getpid()} {step} {time.time()}")
            step += 1
            time.sleep(args.step_sleep)
            if step == args.steps:
                break
    final = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": schedule.state_dict(),
        "rng": torch.get_rng_state(),
        "epoch": loader.sampler.epoch,
    }
    torch.save(final, out / "final" / f"{ctx.rank}.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
