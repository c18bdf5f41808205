"""The training script of the soak: resumes exactly and records every sample it consumes.

    lockstep run --nproc-per-node 2 benchmarks/soak/soak_train.py --out /tmp/soak --steps 40

A dataset of N_SAMPLES ids is dealt by `lockstep.shard`; the model is wrapped in
`lockstep.DistributedDataParallel` and trained with Adam; a checkpoint (model,
optimizer, sampler and the consumption counts) is written after every step. Each
step all-gathers the ids of the global batch so that every rank counts, per epoch,
how often each id was consumed; the counts ride in the checkpoint, so they
describe exactly the trajectory that survived the kills. Rank 0 writes the final
parameters, optimizer state and counts to OUT/final.pt.

For the soak driver (benchmarks/soak/soak_two_nodes.py) each worker writes its pid
to OUT/pids/RANK, rank 0 writes "PID STEP" to OUT/progress after each save, and
every rank appends "PID STEP TIME" to OUT/steps/RANK after each step.
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
import torch.distributed as dist
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
        if flag.exists() and flag.read_text().strip() == str(rank):
            flag.unlink(missing_ok=True)
            write_atomically(out / "in_backward", str(os.getpid()))
            time.sleep(5)

    model[0].weight.register_hook(on_grad)


def count_ids(counts: torch.Tensor, epoch: int, ids: torch.Tensor, world_size: int) -> None:
    """Add the global batch's ids (gathered from every rank) to this epoch's counts."""
    gathered = [torch.empty_like(ids) for _ in range(world_size)]
    dist.all_gather(gathered, ids)
    counts[epoch].index_add_(0, torch.cat(gathered), torch.ones(ids.numel() * world_size).int())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.out)
    ctx = lockstep.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    ddp = lockstep.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = lockstep.shard(Numbered(), BATCH, seed=5)
    epochs = args.steps * BATCH * ctx.world_size // N_SAMPLES + 2
    checkpointer = lockstep.Checkpointer(out / "ckpt", keep=2, timeout_s=60)
    if ctx.rank == 0:
        checkpointer.files.on_point = pause_in_save(out)
    step = checkpointer.restore(model=ddp, optimizer=optimizer, sampler=loader)
    step = 0 if step is None else step
    counts = torch.zeros(epochs, N_SAMPLES, dtype=torch.int32)
    if checkpointer.extra is not None:
        counts = checkpointer.extra["counts"]
    for folder in ("pids", "steps"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    write_atomically(out / "pids" / str(ctx.rank), str(os.getpid()))
    pause_in_backward(model, out, ctx.rank)
    while step < args.steps:
        for x, y, ids in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            count_ids(counts, loader.sampler.epoch, ids, ctx.world_size)
            step += 1
            parts = {"model": ddp, "optimizer": optimizer, "sampler": loader}
            checkpointer.save(step, **parts, extra={"counts": counts})
            if ctx.rank == 0:
                write_atomically(out / "progress", f"{os.getpid()} {step}")
            with open(out / "steps" / str(ctx.rank), "a") as log:
                log.write(f"{os.getpid()} {step} {time.time()}\n")
            time.sleep(args.step_sleep)
            if step == args.steps:
                break
    if ctx.is_main:
        final = {"params": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**final, "counts": counts, "epoch": loader.sampler.epoch}, out / "final.pt")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
