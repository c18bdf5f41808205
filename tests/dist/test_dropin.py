"""torch DDP scripts run unchanged on lockstep's class: results equal torch's, rank by rank.

Every scenario of `dropin_scenarios.py` runs with both classes in the same ranks.
World size 2: bitwise (sums of two numbers do not depend on order; 1/2 is exact).
World size 4: the backend's reduction order depends on how buffers are cut, so
agreement is to 1e-6 (float32), and 1e-2 where gradients are summed in bfloat16
(scenario mixed_precision_bf16_reduce); scenarios whose arithmetic is the same
bucket for bucket are still bitwise there, but the tolerance is stated once for all.
"""

from __future__ import annotations

import pytest
import torch
from dropin_scenarios import SCENARIOS, run_all

from lockstep.testing import run_ranks

TOLERANCE = {2: 0.0, 4: 1e-6}
# Sums in bfloat16 (8 bits of mantissa) whose order depends on how buffers are cut:
# one rounding step of a gradient, times the learning rate, at world size 4.
BF16_SUM_TOLERANCE = {2: 0.0, 4: 1e-2}


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    world = request.param
    return world, run_ranks(run_all, world, list(SCENARIOS), deadline_s=300)


def _same(a, b, tol: float, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], tol, f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        if tol == 0.0:
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=where)
    else:
        assert a == b, where


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_matches_torch(runs, name):
    world, per_rank = runs
    for rank, results in enumerate(per_rank):
        ours, theirs = results[(name, "lockstep")], results[(name, "torch")]
        assert "error" not in ours, f"rank {rank}: {ours.get('error')}"
        assert "error" not in theirs, f"rank {rank} (torch): {theirs.get('error')}"
        ours = {k: v for k, v in ours.items() if k not in ("synced_steps", "warnings")}
        theirs = {k: v for k, v in theirs.items() if k not in ("synced_steps", "warnings")}
        tol = (BF16_SUM_TOLERANCE if name == "mixed_precision_bf16_reduce" else TOLERANCE)[world]
        _same(ours, theirs, tol, f"{name}@rank{rank}")


def test_toggling_the_attribute_synchronises_once_per_step(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("toggle_sync", "lockstep")]["synced_steps"] == 3  # not 6


def test_create_graph_warns_once(runs):
    _, per_rank = runs
    for results in per_rank:
        said = [results[(n, "lockstep")]["warnings"] for n in ("create_graph", "create_graph_views")]
        assert sorted(said) == [0, 1]  # the first scenario in the process sees it, once


def test_join_throw_raises_on_every_rank(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("join_throw", "lockstep")]["raised"] == "RuntimeError"
