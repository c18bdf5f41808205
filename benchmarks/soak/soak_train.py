"""The training script of the soak: resumes exactly and records every sample it consumes.

    lockstep run --nproc-per-node 2 benchmarks/soak/soak_train.py --out /tmp/soak --steps 40

A dataset of N_SAMPLES ids is dealt by `lockstep.shard`; the model is wrapped in
`lockstep.DistributedDataParallel` and trained with Adam; a checkpoint (model,
optimizer, sampler) is written after every step, numbered as `Checkpointer.save`
documents: `save(step)` with the index of the step just finished, and the script
resumes at `restore() + 1`. `--batchnorm` adds a BatchNorm layer, whose buffers
DDP broadcasts at every forward. Rank 0 writes the final parameters, buffers and
optimizer state to OUT/final.pt. The script runs no collective of its own (live recovery routes
only lockstep's): the sample ids are checked by the driver from the ranks' logs.

For the soak driver (benchmarks/soak/soak_two_nodes.py) each worker writes its pid
to OUT/pids/RANK; rank 0 writes "PID DONE" to OUT/progress after each save (DONE:
steps finished, the saved index + 1). Every rank appends, flushed, one line per
step to OUT/ids/RANK when it has drawn the batch, before the forward, "PID STEP
EPOCH ID,ID,..." (the step's index, the sampler's epoch, the batch's sample ids),
and "PID STEP TIME" to OUT/steps/RANK when the step is done. A step is logged
before it can count as finished, so a kill never leaves a finished step unlogged;
a step done again logs again, and its last line is the one that counts.
When OUT/pause_in_save exists, rank 0 removes it at its next checkpoint write,
with the temporary file written but not committed, writes its pid to OUT/in_save
and sleeps, so that the driver can SIGKILL it in the middle of that write. When
OUT/pause_in_backward holds a rank, that rank removes it inside its next backward,
before its gradients are all-reduced (its peers wait in the all-reduce), writes its
pid to OUT/in_backward and sleeps the same way.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

import lockstep

N_SAMPLES, BATCH, FEATURES = 48, 3, 8


class Numbered(torch.utils.data.Dataset):
    """Sample i: features drawn from a generator seeded by i, a target, and the id i."""

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int):
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        return x, x.sum(dim=0, keepdim=True).sin(), i


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pause_in_save(out: Path):
    """The checkpoint hook: hold rank 0 inside a write when the driver asks for it."""

    def on_point(point: str) -> None:
        flag = out / "pause_in_save"
        if point == "temp_written" and flag.exists():
            flag.unlink(missing_ok=True)
            write_atomically(out / "in_save", str(os.getpid()))
            time.sleep(5)

    return on_point


def pause_in_backward(model: nn.Module, out: Path, rank: int) -> None:
    """A gradient hook that holds this rank inside backward when the driver asks for it."""
    flag = out / "pause_in_backward"

    def on_grad(grad: torch.Tensor) -> None:
        try:  # every rank looks; the one named removes it, maybe between another's two looks
            named = flag.read_text().strip()
        except FileNotFoundError:
            return
        if named == str(rank):
            flag.unlink(missing_ok=True)
            write_atomically(out / "in_backward", str(os.getpid()))
            time.sleep(5)

    model[0].weight.register_hook(on_grad)


def append_line(path: Path, line: str) -> None:
    """Append one line and flush it (one write, so a kill never leaves half of it)."""
    with open(path, "a") as log:
        log.write(line + "\n")


def log_batch(out: Path, rank: int, step: int, epoch: int, ids: torch.Tensor) -> None:
    """Record which samples this rank's `step` consumes, in which epoch (OUT/ids/RANK)."""
    joined = ",".join(str(i) for i in ids.tolist())
    append_line(out / "ids" / str(rank), f"{os.getpid()} {step} {epoch} {joined}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--batchnorm", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    ctx = lockstep.init()
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(32) if args.batchnorm else nn.Identity()  # buffers at each forward
    model = nn.Sequential(nn.Linear(FEATURES, 32), norm, nn.Tanh(), nn.Linear(32, 1))
    ddp = lockstep.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = lockstep.shard(Numbered(), BATCH, seed=5)
    checkpointer = lockstep.Checkpointer(out / "ckpt", keep=2, timeout_s=60)
    if ctx.rank == 0:
        checkpointer.files.on_point = pause_in_save(out)
    last = checkpointer.restore(model=ddp, optimizer=optimizer, sampler=loader)
    step = 0 if last is None else last + 1  # the index of the next step
    for folder in ("pids", "ids", "steps"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    write_atomically(out / "pids" / str(ctx.rank), str(os.getpid()))
    pause_in_backward(model, out, ctx.rank)
    while step < args.steps:
        for x, y, ids in loader:
            log_batch(out, ctx.rank, step, loader.sampler.epoch, ids)
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            checkpointer.save(step, model=ddp, optimizer=optimizer, sampler=loader)
            if ctx.rank == 0:
                write_atomically(out / "progress", f"{os.getpid()} {step + 1}")
            append_line(out / "steps" / str(ctx.rank), f"{os.getpid()} {step} {time.time()}")
            step += 1
            time.sleep(args.step_sleep)
            if step == args.steps:
                break
    if ctx.is_main:
        final = {"params": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**final, "epoch": loader.sampler.epoch}, out / "final.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
