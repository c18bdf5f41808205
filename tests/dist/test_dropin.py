"""torch DDP scripts run unchanged on lockstep's class: results equal torch's, rank by rank.

Every scenario of `dropin_scenarios.py` runs with both classes in the same ranks.
World size 2: bitwise (sums of two numbers do not depend on order; 1/2 is exact).
World size 4: the backend's reduction order depends on how buffers are cut, so
agreement is to 1e-6 (float32), and 1e-2 where gradients are summed in bfloat16
(scenario mixed_precision_bf16_reduce); scenarios whose arithmetic is the same
bucket for bucket are still bitwise there, but the tolerance is stated once for all.
Where equal numbers cannot show that an argument was honoured (delayed, bucket_list,
skip_unused, batched_copy), a second test checks what the run was seen doing (the
`seen` entry of its result: its all-reduces, its buckets, the storage of `.grad`),
or bits at world size 3.
"""

from __future__ import annotations

import pytest
import torch
from dropin_scenarios import BUCKET_CAPS_MB, SCENARIOS, run_all
from engine_models import MLP, WithUnused

from lockstep.testing import run_ranks

TOLERANCE = {2: 0.0, 4: 1e-6}
# Sums in bfloat16 (8 bits of mantissa) whose order depends on how buffers are cut:
# one rounding step of a gradient, times the learning rate, at world size 4.
BF16_SUM_TOLERANCE = {2: 0.0, 4: 1e-2}


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
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
        ours = {k: v for k, v in ours.items() if k not in ("synced_steps", "warnings", "seen")}
        theirs = {k: v for k, v in theirs.items() if k not in ("synced_steps", "warnings", "seen")}
        tol = (BF16_SUM_TOLERANCE if name == "mixed_precision_bf16_reduce" else TOLERANCE)[world]
        _same(ours, theirs, tol, f"{name}@rank{rank}")


def test_toggling_the_attribute_synchronises_once_per_step(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("toggle_sync", "lockstep")]["synced_steps"] == 3  # not 6


def test_create_graph_warns_once(runs):
    _, per_rank = runs
    for results in per_rank:
        said = [
            results[(n, "lockstep")]["warnings"] for n in ("create_graph", "create_graph_views")
        ]
        assert sorted(said) == [0, 1]  # the first scenario in the process sees it, once


def test_join_throw_raises_on_every_rank(runs):
    _, per_rank = runs
    for results in per_rank:
        assert results[("join_throw", "lockstep")]["raised"] == "RuntimeError"


# ----------------------------------------- arguments the numbers alone cannot show
def _numels(model_cls) -> dict[str, int]:
    return {n: p.numel() for n, p in model_cls().named_parameters()}


def _seen(per_rank, name: str, engine: str = "lockstep"):
    for rank, results in enumerate(per_rank):
        assert "error" not in results[(name, engine)], f"rank {rank}: {results[(name, engine)]}"
        yield rank, results[(name, engine)]["seen"]


def test_delayed_parameters_leave_the_buckets_for_one_all_reduce_of_their_own(runs):
    """Each step: one all-reduce of net.4's gradients alone, one of the rest; `.grad` of
    both delayed parameters views one buffer holding exactly them."""
    _, per_rank = runs
    numel = _numels(MLP)
    delayed = {"net.4.weight", "net.4.bias"}
    alone = sum(numel[n] for n in delayed)
    expected = sorted([alone, sum(numel.values()) - alone])
    for rank, seen in _seen(per_rank, "delayed"):
        steps = [sorted(step) for step in seen["all_reduced"]]  # either may start first
        assert steps == [expected] * 3, f"rank {rank}: all-reduced per step {steps}"
        assert sorted(n for b in seen["layout"] for n in b) == sorted(set(numel) - delayed)
        assert len(seen["storages"]) == 1, f"rank {rank}: delayed .grad in {seen['storages']}"
        assert next(iter(seen["storages"]))[1] == alone * 4  # float32: that buffer, no more
    for _, theirs in _seen(per_rank, "delayed", "torch"):  # the oracle ran without the delay
        assert [sum(step) for step in theirs["all_reduced"]] == [sum(numel.values())] * 3


def test_bucket_caps_list_cuts_the_buckets_as_torch_does(runs):
    """The layout and the rebuilt all-reduces equal torch's for the same caps, and each
    bucket closed at its own cap: the first to reach it, not earlier."""
    _, per_rank = runs
    numel = _numels(MLP)
    caps = [int(mb * 1024 * 1024) for mb in BUCKET_CAPS_MB]
    for rank, results in enumerate(per_rank):
        ours = results[("bucket_list", "lockstep")]["seen"]
        theirs = results[("bucket_list", "torch")]["seen"]
        assert ours["layout"] == theirs["layout"], f"rank {rank}: lockstep {ours}, torch {theirs}"
        # The profiler lists gloo's all-reduces as they run; under load two may swap places.
        sizes = [sorted(step) for step in ours["all_reduced"]]
        assert sizes == [sorted(step) for step in theirs["all_reduced"]], f"rank {rank}: {ours}"
        layout = ours["layout"]
        assert len(layout) == 4, f"rank {rank}: {layout}"
        for k, bucket in enumerate(layout[:-1]):
            cap, size = caps[min(k, len(caps) - 1)], 4 * sum(numel[n] for n in bucket)
            assert size >= cap > size - 4 * numel[bucket[-1]], f"rank {rank}: bucket {k}"
        assert [sorted(sum(numel[n] for n in b) for b in layout)] * 2 == sizes


def test_skip_unused_launches_only_buckets_holding_a_gradient(runs):
    """Only `fc` gets gradients: buckets of `never` and `sometimes` alone are not reduced.

    Checked on the steps after the rebuild, whose layout `bucket_layout()` shows.
    """
    _, per_rank = runs
    numel = _numels(WithUnused)
    for rank, seen in _seen(per_rank, "skip_unused"):
        layout = seen["layout"]
        used = [sum(numel[n] for n in b) for b in layout if any(n.startswith("fc.") for n in b)]
        assert len(used) < len(layout), f"rank {rank}: nothing to skip in {layout}"
        for step in seen["all_reduced"][1:]:  # the layout after the rebuild
            # the profiler lists gloo's all-reduces as they run; under load two may swap
            assert sorted(step) == sorted(used), f"rank {rank}: {step}, buckets {layout}"


@pytest.fixture(scope="module")
def runs_at_three():
    """World size 3: 1/3 is not exact, so dividing by 3 and multiplying by the float
    nearest 1/3 differ in bits."""
    return run_ranks(run_all, 3, ["batched_copy", "copy_per_param"], deadline_s=120)


def test_batched_copy_divides_like_torch_at_world_size_three(runs_at_three):
    for rank, results in enumerate(runs_at_three):
        for name in ("batched_copy", "copy_per_param"):
            ours, theirs = results[(name, "lockstep")], results[(name, "torch")]
            assert "error" not in ours and "error" not in theirs, f"rank {rank}: {name}"
            _same(ours, theirs, 0.0, f"{name}@rank{rank}")
        batched = results[("batched_copy", "torch")]["grads"]
        per_param = results[("copy_per_param", "torch")]["grads"]
        assert any(not torch.equal(batched[n], per_param[n]) for n in batched), "no bit differs"
