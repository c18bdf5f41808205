"""Train a small classifier on scikit-learn's digits in one process: the DDP lab's starting point.

    python examples/train_single.py
    python examples/train_single.py --epochs 12    # run it again: resumes, trains 4 more

examples/train_ddp.py is this script plus the lines that data parallelism needs
and nothing else: `diff examples/train_single.py examples/train_ddp.py` shows them.
The data comes from lockstep.shard (in one process: a seeded, resumable shuffle)
and a checkpoint is written after every epoch to runs/digits/train_single; a
re-run resumes from it. The digits ship with scikit-learn: nothing to download.
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
    torch.manual_seed(SEED)
    train, test = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = lockstep.shard(train, GLOBAL_BATCH, seed=SEED)
    checkpointer = lockstep.Checkpointer(args.ckpt_dir, keep=2)
    done = checkpointer.restore(model=model, optimizer=optimizer, sampler=loader) or 0
    if done:
        print(f"resumed after epoch {done} from {args.ckpt_dir}")
    for epoch in range(done + 1, args.epochs + 1):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")
        checkpointer.save(epoch, model=model, optimizer=optimizer, sampler=loader)
    print(f"test accuracy {accuracy(model, test):.4f}")


if __name__ == "__main__":
    main()
