"""Exact resume: k steps, process exits, restore, train to N == N steps without stopping.

The first `run_ranks` call at a world size trains without stopping, then trains
k steps and saves; a second call restores and trains to N, so the ranks really
exit between the halves. The model has dropout and the ranks seed their
generators differently, so the comparison fails unless every rank gets its own
random state back; the dataset returns sample ids, so consumption is compared.
The same two-rank spawn also saves from every kind of wrapper and restores into
every other (it pays once for the imports that optimizers and torch's DDP need).
"""

from __future__ import annotations

import random
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint.state import unwrap
from lockstep.testing import run_ranks

N_SAMPLES, BATCH, TOTAL = 23, 4, 10
STOP = 7  # mid-epoch at both world sizes (6 and 3 batches per epoch)
STOP_2TO1 = 4  # at two ranks: epoch 1, after its first batch
ENGINES = {1: ["plain"], 2: ["ddp", "naive"]}


class Regression(torch.utils.data.Dataset):
    """Sample i: features and target drawn from a generator seeded by i, and the id i."""

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=gen)
        return x, x.sum(dim=0, keepdim=True).sin(), i


def build(ctx, engine):
    torch.manual_seed(100 + ctx.rank)  # per-rank streams: dropout differs across ranks
    random.seed(ctx.rank)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    wrapped = {
        "plain": lambda m: m,
        "naive": lockstep.NaiveDataParallel,
        "ddp": lockstep.DistributedDataParallel,
    }[engine](model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = lockstep.shard(Regression(), BATCH, seed=11)
    return model, wrapped, optimizer, scheduler, loader


def train(ctx, engine, directory, stop_at, restore):
    """Train to TOTAL steps (or save at `stop_at` and return); record (epoch, ids) per step."""
    model, wrapped, optimizer, scheduler, loader = build(ctx, engine)
    parts = {"optimizer": optimizer, "sampler": loader, "scheduler": scheduler}
    checkpointer = lockstep.Checkpointer(directory or ".", timeout_s=30)
    step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if restore:
            step = checkpointer.restore(model=wrapped, **parts)
    restored = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    while step < TOTAL:
        for x, y, ids in loader:
            loss = nn.functional.mse_loss(wrapped(x), y)
            optimizer.zero_grad()
            loss.backward()
            if engine == "naive":
                wrapped.sync_gradients()
            optimizer.step()
            scheduler.step()
            seen.append((loader.sampler.epoch, ids.tolist()))
            step += 1
            if step == stop_at:
                checkpointer.save(step, model=wrapped, **parts)
                return {
                    "seen": seen,
                    "saved": {k: v.clone() for k, v in model.state_dict().items()},
                }
            if step == TOTAL:
                break
    return {
        "seen": seen,
        "restored": restored,
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "draws": (torch.rand(3), random.random()),
        "warnings": [str(w.message) for w in caught],
    }


def assert_equal_tree(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_tree(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


WRAPS = {
    "plain": lambda m: m,
    "torch-ddp": torch.nn.parallel.DistributedDataParallel,
    "lockstep-ddp": lockstep.DistributedDataParallel,
    "naive": lockstep.NaiveDataParallel,
}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in unwrap(model).state_dict().items()}


def interchange(directory):
    """Save from every kind of wrapper, restore into every other: are the states equal?"""
    checks = {}
    for source, wrap in WRAPS.items():
        torch.manual_seed(1)
        saved = wrap(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
        saved(torch.randn(5, 3))  # move the BatchNorm running statistics too
        lockstep.Checkpointer(Path(directory) / source).save(1, model=saved)
        for target, wrap_target in WRAPS.items():
            torch.manual_seed(2)
            model = wrap_target(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
            step = lockstep.Checkpointer(Path(directory) / source).restore(model=model)
            a, b = state(saved), state(model)
            checks[(source, target)] = step == 1 and all(torch.equal(a[k], b[k]) for k in a)
    return checks


def first_halves(ctx, directory):
    """Each engine without stopping, then each engine up to its save (then the process exits)."""
    out = {("whole", e): train(ctx, e, None, -1, False) for e in ENGINES[ctx.world_size]}
    for engine in ENGINES[ctx.world_size]:
        out[("first", engine)] = train(ctx, engine, f"{directory}/{engine}", STOP, False)
    if ctx.world_size == 2:
        out["2to1"] = train(ctx, "ddp", f"{directory}/2to1", STOP_2TO1, False)
        out["interchange"] = interchange(f"{directory}/interchange")
    return out


def second_halves(ctx, directory):
    out = {e: train(ctx, e, f"{directory}/{e}", -1, True) for e in ENGINES[ctx.world_size]}
    if ctx.world_size == 1:
        out["2to1"] = train(ctx, "plain", f"{directory}/2to1", -1, True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four spawns in all: first halves at 2 and 1 ranks, then second halves at 2 and 1."""
    directory = str(tmp_path_factory.mktemp("resume"))
    first = {w: run_ranks(first_halves, w, directory, deadline_s=120) for w in (2, 1)}
    second = {w: run_ranks(second_halves, w, directory, deadline_s=120) for w in (2, 1)}
    return first, second, directory


@pytest.mark.parametrize(
    "world_size,engine",
    [(1, "plain"), (2, "ddp"), (2, "naive")],
    ids=["1-plain", "2-ddp", "2-naive"],
)
def test_stop_exit_restore_continue_is_bitwise_the_uninterrupted_run(runs, world_size, engine):
    first, second, _ = runs
    for rank in range(world_size):
        a = first[world_size][rank][("whole", engine)]
        b = first[world_size][rank][("first", engine)]
        c = second[world_size][rank][engine]
        assert b["seen"] + c["seen"] == a["seen"]  # same ids, same order, same epochs
        assert b["seen"][-1][0] == c["seen"][0][0]  # the stop really is inside an epoch
        assert_equal_tree(b["saved"], c["restored"], "params after restore")
        for part in ("params", "optimizer", "scheduler", "draws"):
            assert_equal_tree(a[part], c[part], part)
        assert c["warnings"] == []
        assert len(a["seen"]) == TOTAL and all(len(ids) == BATCH for _, ids in a["seen"][:5])


def test_a_checkpoint_from_two_ranks_resumes_on_one_and_reshards_the_epoch(runs):
    first, second, _ = runs
    saved = [first[2][rank]["2to1"] for rank in range(2)]
    resumed = second[1][0]["2to1"]
    assert_equal_tree(saved[0]["saved"], resumed["restored"], "params after restore")
    assert any("per-rank random streams restart from the seed" in w for w in resumed["warnings"])
    epoch_one = [i for r in saved for e, ids in r["seen"] if e == 1 for i in ids]
    epoch_one += [i for e, ids in resumed["seen"] if e == 1 for i in ids]
    assert Counter(epoch_one) == Counter(range(N_SAMPLES))  # nothing skipped, nothing twice
    assert [e for e, _ in resumed["seen"]][:5] == [1, 1, 1, 1, 2]


def test_a_wrapped_models_checkpoint_loads_into_the_plain_model_and_back(runs):
    first, _, directory = runs
    for rank in range(2):
        checks = first[2][rank]["interchange"]
        assert len(checks) == 16 and all(checks.values()), checks
    path = Path(directory) / "interchange" / "torch-ddp" / "step_00000001.pt"
    saved = torch.load(path, weights_only=True)["model"]
    assert saved and not any(key.startswith("module.") for key in saved)
