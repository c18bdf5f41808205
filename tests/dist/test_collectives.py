"""lockstep.collectives against gloo's native collectives, at world sizes 1 to 5.

One spawned run per world size holds every check, so the suite stays fast. Each
rank returns the list of checks that failed (empty when all passed). Oracles:
integer-valued data must match the native result bitwise in every dtype (the
sums are exact in any order); random data must lie within the rounding bound of
the exact float64 sum, as the native result does; at world size 2, where each
element is one addition, random data must match native bitwise too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lockstep.collectives import (
    all_gather,
    all_reduce_halving_doubling,
    all_reduce_naive,
    all_reduce_ring,
    all_reduce_tree,
    broadcast_linear,
    broadcast_tree,
    reduce_scatter,
    reduce_tree,
)
from lockstep.testing import run_ranks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ring_small_segments(tensor, op=dist.ReduceOp.SUM, group=None):
    """The ring in 40-byte segments: many per step, some empty, chunks of unequal length."""
    all_reduce_ring(tensor, op, group, segment_bytes=40)


ALL_REDUCES = {
    "naive": all_reduce_naive,
    "tree": all_reduce_tree,
    "ring": all_reduce_ring,
    "ring_segmented": _ring_small_segments,
    "halving_doubling": all_reduce_halving_doubling,
}


def _lengths(world_size: int) -> list[int]:
    """Shorter than, not divisible by, and a few times the world size; one larger odd length."""
    return sorted({1, max(1, world_size - 1), 3 * world_size + 1, 1237})


def _data(rank: int, numel: int, dtype: torch.dtype, seed: int, integer: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * seed + rank)
    if integer:
        return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
    return torch.randn(numel, generator=gen).to(dtype)


def _native_sum(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def _same_on_all_ranks(tensor: torch.Tensor) -> bool:
    first = tensor.clone()
    dist.broadcast(first, 0)
    return torch.equal(first, tensor)


def _bound(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact sum (float64) and the allowed error |r - exact| <= N * eps * sum|x|.

    N-1 additions, each rounded by at most eps/2 of a partial sum no larger than
    sum|x|: the bound is twice that.
    """
    exact = _native_sum(x.double())
    scale = _native_sum(x.double().abs())
    world_size = dist.get_world_size()
    return exact, world_size * torch.finfo(x.dtype).eps * scale + torch.finfo(x.dtype).tiny


def _within_bound(result: torch.Tensor, x: torch.Tensor, bound=None) -> bool:
    exact, allowed = bound if bound is not None else _bound(x)
    return bool(((result.double() - exact).abs() <= allowed).all())


def _check_all_reduces(ctx) -> list[str]:
    fails = []
    for (name, fn), dtype, numel in _cases(ctx.world_size):
        for integer in (True, False):
            x = _data(ctx.rank, numel, dtype, seed=numel, integer=integer)
            ours, native = x.clone(), _native_sum(x)
            pointer = ours.data_ptr()
            fn(ours)
            label = f"{name} {dtype} n={numel} integer={integer}"
            if ours.data_ptr() != pointer:
                fails.append(f"{label}: not in place")
            if not _same_on_all_ranks(ours):
                fails.append(f"{label}: ranks disagree")
            exact = integer or ctx.world_size <= 2
            if exact and not torch.equal(ours, native):
                fails.append(f"{label}: differs from native, max {(ours - native).abs().max()}")
            if not integer:
                bound = _bound(x)
                if not _within_bound(ours, x, bound):
                    fails.append(f"{label}: outside the rounding bound")
                if not _within_bound(native, x, bound):
                    fails.append(f"{label}: native outside the bound (bound too tight)")
    return fails


def _cases(world_size: int):
    for item in ALL_REDUCES.items():
        for dtype in DTYPES:
            for numel in _lengths(world_size):
                yield item, dtype, numel


def _check_ops(ctx) -> list[str]:
    """AVG, PRODUCT, MIN, MAX on fp32, and a 2-D tensor, against native."""
    fails = []
    x = _data(ctx.rank, 2 * ctx.world_size + 3, torch.float32, seed=3, integer=False)
    x = x.view(-1, 1) + 1.5
    for op_name in ("AVG", "PRODUCT", "MIN", "MAX"):
        op = getattr(dist.ReduceOp, op_name)
        native = x.clone()
        dist.all_reduce(native, op=op)
        for name, fn in ALL_REDUCES.items():
            ours = x.clone()
            fn(ours, op)
            if not torch.allclose(ours, native, rtol=1e-5, atol=1e-6):
                fails.append(f"{name} {op_name}: differs from native")
    return fails


def _check_broadcast_reduce(ctx) -> list[str]:
    fails = []
    for dtype in DTYPES:
        for root in range(ctx.world_size):
            x = _data(ctx.rank, 3 * ctx.world_size + 2, dtype, seed=root, integer=False)
            native = x.clone()
            dist.broadcast(native, root)
            for fn in (broadcast_linear, broadcast_tree):
                ours = x.clone()
                fn(ours, root)
                if not torch.equal(ours, native):
                    fails.append(f"{fn.__name__} {dtype} root={root}: differs from native")
            fails += _check_reduce(ctx, dtype, root)
    return fails


def _check_reduce(ctx, dtype: torch.dtype, root: int) -> list[str]:
    x = _data(ctx.rank, 2 * ctx.world_size + 5, dtype, seed=root, integer=True)
    native, ours = x.clone(), x.clone()
    dist.reduce(native, root)
    reduce_tree(ours, root)
    if ctx.rank == root and not torch.equal(ours, native):
        return [f"reduce_tree {dtype} root={root}: differs from native"]
    if ctx.rank != root and not torch.equal(ours, x):
        return [f"reduce_tree {dtype} root={root}: changed a non-root tensor"]
    return []


def _check_scatter_gather(ctx) -> list[str]:
    fails, size = [], ctx.world_size
    for dtype in DTYPES:
        for integer in (True, False):
            x = _data(ctx.rank, 3 * size, dtype, seed=11, integer=integer)
            native, ours = torch.empty(3, dtype=dtype), torch.empty(3, dtype=dtype)
            dist.reduce_scatter_single(native, x)
            reduce_scatter(ours, x)
            same = torch.equal(ours, native) or (
                not integer and torch.allclose(ours, native, rtol=0.05, atol=0.05)
            )
            if not same:
                fails.append(f"reduce_scatter {dtype} integer={integer}: differs from native")
        part = _data(ctx.rank, 5, dtype, seed=13, integer=False)
        native, ours = torch.empty(5 * size, dtype=dtype), torch.empty(5 * size, dtype=dtype)
        dist.all_gather_single(native, part)
        all_gather(ours, part)
        if not torch.equal(ours, native):
            fails.append(f"all_gather {dtype}: differs from native")
    return fails


def _check_bad_input(ctx) -> list[str]:
    strided = torch.zeros(4, 4).t()
    try:
        all_reduce_ring(strided)
    except ValueError as error:
        return [] if "contiguous" in str(error) else [f"unclear message: {error}"]
    return ["a non-contiguous tensor was accepted"]


def _all_checks(ctx) -> list[str]:
    return (
        _check_all_reduces(ctx)
        + _check_ops(ctx)
        + _check_broadcast_reduce(ctx)
        + _check_scatter_gather(ctx)
        + _check_bad_input(ctx)
    )


@pytest.mark.parametrize(
    "world_size", [1, 2, 3, *(pytest.param(n, marks=pytest.mark.slow) for n in (4, 5))]
)
def test_collectives_match_native(world_size):
    results = run_ranks(_all_checks, world_size, timeout_s=30, deadline_s=110)
    failures = [f"rank {rank}: {fail}" for rank, fails in enumerate(results) for fail in fails]
    assert not failures, "\n".join(failures[:40])
