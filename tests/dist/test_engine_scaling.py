"""Averaging arithmetic at a world size where 1/N is inexact: bitwise equal to torch DDP.

Like torch DDP, the engine multiplies a copied gradient by 1/N and divides one
found in place (in its bucket view) by N; unlike it, the division waits until
the bucket is complete and then runs once over the flat buffer
(`Bucket.divide_found_in_place`). At N = 3, x * (1/3) and x / 3 differ in the last
bit for some x, and the multiplier's rounding depends on the dtype, so only the
same operation in the same math type gives the same bits. Every rank trains on
the same batch, so the sum of the N scaled copies is the same whatever order the
backend adds them in: any difference left is the scaling's.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import build
from torch import nn

import lockstep
from lockstep.testing import run_ranks

WORLD = 3
STEPS = 3

# How each step's gradients reach the hooks, per parameter: left in place from
# the last step (zero_grad(set_to_none=False)), fresh tensors (set_to_none=True),
# or both within one bucket (one parameter's gradient dropped before backward).
# The multiplier's rounding depends on the dtype, so the copied way runs in each.
WAYS = {
    "in_place": {"set_to_none": False, "drop": (), "dtype": torch.float32},
    "copied": {"set_to_none": True, "drop": (), "dtype": torch.float32},
    "mixed": {"set_to_none": False, "drop": ("net.2.weight",), "dtype": torch.float32},
    "copied_bf16": {"set_to_none": True, "drop": (), "dtype": torch.bfloat16},
    "copied_fp64": {"set_to_none": True, "drop": (), "dtype": torch.float64},
    "in_place_bf16": {"set_to_none": False, "drop": (), "dtype": torch.bfloat16},
}


def _train(engine: str, way: str, rank: int) -> dict[str, torch.Tensor]:
    dtype = WAYS[way]["dtype"]
    model = build("mlp").to(dtype)
    if rank == 1:  # a different start: the wrap's broadcast must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    if engine == "lockstep":
        wrapped = lockstep.DistributedDataParallel(model)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=WAYS[way]["set_to_none"])
        for name, p in model.named_parameters():
            if name in WAYS[way]["drop"]:
                p.grad = None
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        x, y = x.to(dtype), y.to(dtype)
        ((wrapped(x) - y) ** 2).mean().backward()
        for name, p in model.named_parameters():
            out[f"step{step}.grad.{name}"] = p.grad.detach().clone()
        opt.step()
    return out


def _both_engines(ctx) -> dict:
    return {
        (engine, way): _train(engine, way, ctx.rank)
        for engine in ("lockstep", "torch")
        for way in WAYS
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_both_engines, WORLD, deadline_s=180, timeout_s=60)


@pytest.mark.parametrize("way", list(WAYS))
def test_gradients_match_torch_ddp_bitwise_at_world_size_3(results, way):
    for rank, result in enumerate(results):
        ours, theirs = result[("lockstep", way)], result[("torch", way)]
        assert ours.keys() == theirs.keys()
        for key in ours:
            diff = (ours[key] - theirs[key]).abs().max().item()
            assert torch.equal(ours[key], theirs[key]), f"rank {rank} {way} {key}: {diff:.3g}"


def test_the_scaling_is_visible_at_world_size_3(results):
    """The check can fail: x * (1/3) and x / 3 differ on some of these gradients."""
    grads = results[0][("torch", "copied")]
    differ = sum(int(not torch.equal(g * (1.0 / WORLD), g / WORLD)) for g in grads.values())
    assert differ > 0
