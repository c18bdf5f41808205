"""Train a small classifier on scikit-learn's digits with data parallelism: the DDP lab's result.

    lockstep run --nproc-per-node 2 examples/train_ddp.py
    python examples/train_ddp.py                     # one process: train_single.py's numbers

This is examples/train_single.py plus the lines that data parallelism needs:
join the job, wrap the model, give each rank its share of the data (the global
batch divided by the world size), and print from rank 0 only. The Checkpointer
line is unchanged: only rank 0 writes, after every epoch, to runs/digits/train_ddp,
and a re-run resumes from it, at any world size.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import lockstep

SEED = 0
GLOBAL_BATCH = 64  # samples per optimizer step, over all processes together
TEST_SAMPLES = 360


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train an MLP on the digits dataset.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--ckpt-dir", default=f"runs/digits/{Path(__file__).stem}")
    return parser.parse_args()


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 8x8 digit images as 64 features in [0, 1]; a fixed train/test split."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SEED))
    test, train = order[:TEST_SAMPLES], order[TEST_SAMPLES:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    args = parse_args()
    ctx = lockstep.init()
    torch.manual_seed(SEED)
    train, test = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = lockstep.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = lockstep.shard(train, GLOBAL_BATCH // ctx.world_size, seed=SEED)
    checkpointer = lockstep.Checkpointer(args.ckpt_dir, keep=2)
    done = checkpointer.restore(model=model, optimizer=optimizer, sampler=loader) or 0
    if done and ctx.is_main:
        print(f"resumed after epoch {done} from {args.ckpt_dir}")
    for epoch in range(done + 1, args.epochs + 1):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if ctx.is_main:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
        checkpointer.save(epoch, model=model, optimizer=optimizer, sampler=loader)
    if ctx.is_main:
        print(f"test accuracy {accuracy(model, test):.4f}")
    lockstep.shutdown()


if __name__ == "__main__":
    main()
