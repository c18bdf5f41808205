"""The engine's parity holds with each all-reduce algorithm of `lockstep.collectives`.

Each algorithm sums the same addends; at world size 2 the sum of two numbers is
order-free, so results must be bitwise equal to the native all-reduce. At
world size 4 (hierarchical: two simulated nodes of two ranks) the order of the
four additions differs from the backend's, so agreement is to 1e-6 absolute.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_models import SCENARIOS, train

from lockstep.testing import run_ranks

ALGORITHMS = ("ring", "tree", "hierarchical")
CHOSEN = ("mlp", "tied", "unused_on_some_ranks", "no_sync_4_micro", "tiny_buckets")


def _train_each(ctx):
    out = {}
    for s in SCENARIOS:
        if s.name not in CHOSEN:
            continue
        out[(s.name, "native")] = train("lockstep", s, ctx.rank, ctx.world_size)
        for algorithm in ALGORITHMS:
            kwargs = {**s.ddp_kwargs, "allreduce": algorithm}
            if algorithm == "hierarchical":
                kwargs["local_world_size"] = 2 if ctx.world_size % 2 == 0 else 1
            chosen = dataclasses.replace(s, ddp_kwargs=kwargs)
            out[(s.name, algorithm)] = train("lockstep", chosen, ctx.rank, ctx.world_size)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_each_algorithm_matches_native_engine(world):
    results = run_ranks(_train_each, world, deadline_s=240, timeout_s=60)
    for name in CHOSEN:
        native = results[0][(name, "native")]["params"]
        for algorithm in ALGORITHMS:
            for rank in range(world):
                params = results[rank][(name, algorithm)]["params"]
                for key, value in params.items():
                    if world == 2:
                        assert torch.equal(value, native[key]), (name, algorithm, key)
                    else:
                        torch.testing.assert_close(value, native[key], atol=1e-6, rtol=0)
