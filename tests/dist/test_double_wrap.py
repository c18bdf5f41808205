"""A model wrapped twice in data-parallel wrappers is refused on every rank, naming both.

Each pair is built on 2 real gloo ranks; the refusal comes at wrap time when the
outer wrapper is lockstep's (it searches the module tree), at the first forward
when the outer one is torch's DDP (lockstep's forward sees torch's running). Every
rank must raise `DoubleWrapError` with both names and what to do.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import MLP
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from lockstep.testing import run_ranks
from lockstep.testing.mesh import device_mesh


def sharded(module: nn.Module) -> nn.Module:
    return lockstep.ShardedDataParallel(module, stage=2)


PAIRS = {  # outer, inner, how to build outer(inner(MLP()))
    "lockstep DDP inside torch DDP": (
        "torch.nn",
        "lockstep.Dist",
        lambda: TorchDDP(lockstep.DistributedDataParallel(MLP())),
    ),
    "torch DDP inside lockstep DDP": (
        "lockstep.Dist",
        "torch.nn",
        lambda: lockstep.DistributedDataParallel(TorchDDP(MLP())),
    ),
    "lockstep DDP inside lockstep DDP": (
        "lockstep.Dist",
        "lockstep.Dist",
        lambda: lockstep.DistributedDataParallel(lockstep.DistributedDataParallel(MLP())),
    ),
    "sharded inside lockstep DDP": (
        "lockstep.Dist",
        "lockstep.Sharded",
        lambda: lockstep.DistributedDataParallel(sharded(MLP())),
    ),
    "sharded inside torch DDP": ("torch.nn", "lockstep.Sharded", lambda: TorchDDP(sharded(MLP()))),
    "lockstep DDP inside sharded": (
        "lockstep.Sharded",
        "lockstep.Dist",
        lambda: sharded(lockstep.DistributedDataParallel(MLP())),
    ),
    "torch DDP inside sharded": ("lockstep.Sharded", "torch.nn", lambda: sharded(TorchDDP(MLP()))),
    "sharded inside sharded": (
        "lockstep.Sharded",
        "lockstep.Sharded",
        lambda: sharded(sharded(MLP())),
    ),
    "fully_shard inside lockstep DDP": (
        "lockstep.Dist",
        "fully_shard",
        lambda: lockstep.DistributedDataParallel(fully_shard(MLP(), mesh=device_mesh("cpu"))),
    ),
    "a wrapped submodule inside lockstep DDP": (
        "lockstep.Dist",
        "lockstep.Dist",
        lambda: lockstep.DistributedDataParallel(
            nn.Sequential(lockstep.DistributedDataParallel(MLP()), nn.Linear(4, 4))
        ),
    ),
}


def _try_pairs(ctx):
    out = {}
    for what, (_, _, build) in PAIRS.items():
        try:
            torch.manual_seed(0)
            model = build()
            model(torch.randn(2, 8)).sum().backward()
            out[what] = None
        except Exception as error:  # the type is checked in the test
            out[what] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def refusals():
    return run_ranks(_try_pairs, 2, deadline_s=120.0)


@pytest.mark.parametrize("what", list(PAIRS))
def test_double_wrapping_is_refused_on_every_rank(refusals, what):
    outer, inner, _ = PAIRS[what]
    for rank, found in enumerate(r[what] for r in refusals):
        assert found is not None, f"rank {rank} accepted {what}"
        assert found.startswith("DoubleWrapError: "), found
        first, second = found.index(outer), found.index(inner, found.index(" wraps "))
        assert first < second, found  # "<outer> wraps <inner>"
        assert f"on rank {rank}" in found and "wrap the plain model once" in found, found
