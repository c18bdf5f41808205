"""torch DDP scripts run unchanged on lockstep's class: results equal torch's, rank by rank.

Every scenario of `dropin_scenarios.py` runs with both classes in the same ranks.
World size 2: bitwise (sums of two numbers do not depend on order; 1/2 is exact).
World size 4: the backend's reduction order depends on how buffers are cut, so
agreement is to 1e-6 (float32); scenarios whose arithmetic is the same bucket for
bucket are still bitwise there, but the tolerance is stated once for all.
"""

from __future__ import annotations

import pytest
import torch
from dropin_scenarios import SCENARIOS, run_all

from lockstep.testing import run_ranks

TOLERANCE = {2: 0.0, 4: 1e-6}


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
        _same(ours, theirs, TOLERANCE[world], f"{name}@rank{rank}")


def test_toggling_the_attribute_synchronises_once_per_step(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("toggle_sync", "lockstep")]["synced_steps"] == 3  # not 6


def test_create_graph_warns_once(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("create_graph", "lockstep")]["warnings"] <= 1


def test_join_throw_raises_on_every_rank(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("join_throw", "lockstep")]["raised"] == "RuntimeError"
