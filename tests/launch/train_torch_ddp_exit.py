"""A torch-DDP script shaped like the DDP tutorial: the model lives in main()'s locals.

    lockstep run --nproc-per-node 2 tests/launch/train_torch_ddp_exit.py --out DIR
    torchrun --nproc-per-node 2 tests/launch/train_torch_ddp_exit.py --out DIR [--lockstep]

torch's own DistributedDataParallel is made inside a `Trainer` held by main(); the
script trains a few epochs, rank 0 writes a snapshot, main() destroys the group and
returns. Freeing main()'s locals then frees the last Python reference to the DDP
module: the exit path that used to hang. `--lockstep` imports lockstep (torchrun).
`--engine lockstep` uses lockstep.DistributedDataParallel instead of torch's class,
`--engine sharded` lockstep.FSDP (ZeRO-3).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model: nn.Module, data: DataLoader, optimizer, snapshot: Path) -> None:
        self.model = model
        self.data = data
        self.optimizer = optimizer
        self.snapshot = snapshot

    def run_epoch(self, epoch: int) -> None:
        self.data.sampler.set_epoch(epoch)
        for x, y in self.data:
            self.optimizer.zero_grad()
            nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizer.step()

    def train(self, epochs: int) -> None:
        for epoch in range(epochs):
            self.run_epoch(epoch)
            state = {"model": self.model.state_dict(), "epoch": epoch}  # sharded: a collective
            if dist.get_rank() == 0:
                torch.save(state, self.snapshot)


def build(engine: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    if engine == "torch":
        return DistributedDataParallel(model)
    import lockstep

    if engine == "sharded":
        return lockstep.FSDP(model)
    return lockstep.DistributedDataParallel(model)


def main(out: Path, engine: str, epochs: int) -> None:
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(256, 20, generator=gen), torch.randn(256, 1, generator=gen))
    data = DataLoader(dataset, batch_size=32, shuffle=False, sampler=DistributedSampler(dataset))
    model = build(engine)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = Trainer(model, data, optimizer, out / "snapshot.pt")
    trainer.train(epochs)
    dist.destroy_process_group()
    (out / f"done_{os.environ['RANK']}").write_text("ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=["torch", "lockstep", "sharded"], default="torch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lockstep", action="store_true", help="import lockstep first")
    args = parser.parse_args()
    if args.lockstep:
        import lockstep  # noqa: F401
    main(Path(args.out), args.engine, args.epochs)
