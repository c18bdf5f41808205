"""`make_allreduce` (the engine's choice of algorithm) and the hierarchical all-reduce.

Every name is checked against gloo's native all-reduce, with simulated nodes
for "hierarchical" (world size 4 as 2 nodes x 2, world size 6 as 3 x 2 and 2 x 3),
on sub-groups running side by side, from a separate thread (as the engine calls
it), and bad input raises the same error on every rank.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from test_collectives import DTYPES, _data, _native_sum, _within_bound

from lockstep.collectives import ACCEPTED, make_allreduce
from lockstep.errors import RankMismatchError
from lockstep.testing import run_ranks

FLAT = ("native", "naive", "tree", "ring", "halving_doubling")


def _check_sum(fn, rank: int, label: str, group=None) -> list[str]:
    """fn against native SUM: integer data bitwise, random data within the rounding bound."""
    fails = []
    for dtype in DTYPES:
        for integer in (True, False):
            x = _data(rank, 1001, dtype, seed=17, integer=integer)
            native = x.clone()
            dist.all_reduce(native, group=group)
            ours = x.clone()
            fn(ours)
            if integer and not torch.equal(ours, native):
                fails.append(f"{label} {dtype}: differs from native on integer data")
            if not integer and group is None and not _within_bound(ours, x):
                fails.append(f"{label} {dtype}: outside the rounding bound")
    return fails


def _layouts(world_size: int) -> list[int]:
    """Every local_world_size that divides the world size: 1 node to one rank per node."""
    return [lws for lws in range(1, world_size + 1) if world_size % lws == 0]


def _check_names(ctx) -> list[str]:
    fails = []
    for name in FLAT:
        fn = make_allreduce(name, None, ctx.local_world_size)
        fails += _check_sum(fn, ctx.rank, name)
    for lws in _layouts(ctx.world_size):
        fn = make_allreduce("hierarchical", None, lws)
        fails += _check_sum(fn, ctx.rank, f"hierarchical lws={lws}")
    with ThreadPoolExecutor(1) as thread:
        fn = make_allreduce("ring", None, 1)
        x = _data(ctx.rank, 333, torch.float32, seed=5, integer=True)
        ours = x.clone()
        thread.submit(fn, ours).result()
        if not torch.equal(ours, _native_sum(x)):
            fails.append("ring from a thread: differs from native")
    return fails + _check_errors(ctx)


def _expect(error_type, words: list[str], what: str, *args) -> list[str]:
    """make_allreduce(*args) must raise `error_type` with every word of `words` in it."""
    try:
        make_allreduce(*args)
    except error_type as error:
        missing = [word for word in words if word not in str(error)]
        return [f"{what}: the message lacks {missing}: {error}"] if missing else []
    return [f"{what} was accepted"]


def _check_errors(ctx) -> list[str]:
    fails = _expect(ValueError, list(ACCEPTED), "an unknown name", "butterfly", None, 1)
    fails += _expect(ValueError, ["local_world_size >= 1"], "local_world_size 0", "ring", None, 0)
    if ctx.world_size > 1:
        name = "ring" if ctx.rank == 0 else "tree"
        words = ["'tree'", "'ring'", "rank 0"]
        fails += _expect(
            RankMismatchError, words, "different names on different ranks", name, None, 1
        )
    if ctx.world_size == 4:
        words = ["local_world_size", "divide"]
        fails += _expect(
            ValueError, words, "local_world_size 3 at world size 4", "hierarchical", None, 3
        )
    return fails


def _check_sub_groups(ctx) -> list[str]:
    """Two sub-groups, {0, 2} and {1, 3}, each running every algorithm at the same time."""
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    group = evens if ctx.rank % 2 == 0 else odds
    fails = []
    for name in (*FLAT, "hierarchical"):
        fn = make_allreduce(name, group, 2)
        label = f"{name} on a sub-group"
        fails += _check_sum(fn, ctx.rank, label, group=group)
    return fails


def _checks(ctx) -> list[str]:
    fails = _check_names(ctx)
    if ctx.world_size == 4:
        fails += _check_sub_groups(ctx)
    return fails


def _check_hierarchical_only(ctx) -> list[str]:
    fails = []
    for lws in (2, 3):
        fn = make_allreduce("hierarchical", None, lws)
        fails += _check_sum(fn, ctx.rank, f"hierarchical lws={lws}")
    return fails


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_make_allreduce_matches_native(world_size):
    results = run_ranks(_checks, world_size, timeout_s=30, deadline_s=110)
    failures = [f"rank {rank}: {fail}" for rank, fails in enumerate(results) for fail in fails]
    assert not failures, "\n".join(failures[:40])


def test_hierarchical_at_world_size_six():
    results = run_ranks(_check_hierarchical_only, 6, timeout_s=30, deadline_s=110)
    failures = [f"rank {rank}: {fail}" for rank, fails in enumerate(results) for fail in fails]
    assert not failures, "\n".join(failures[:40])
