"""The engine's core property: bucketed == naive == torch DDP == one process, global batch.

Scenarios (engine_models.SCENARIOS): an MLP, tied weights, BatchNorm, a frozen
part, unused parameters (also unused on some ranks only), no_sync over 4
micro-batches, tiny buckets, one bucket, and gradient copies instead of views.
Tolerance: where the arithmetic is the same (world size 1 and 2, where the
all-reduce of two addends is order-free and 1/N is exact) results must be
bitwise equal; at world size 4 the sum of four addends depends on how the
backend splits the buffer, so agreement is to 1e-6 absolute. Against one
process on the global batch (a different summation order) the tolerance is
1e-5 absolute in float32.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import SCENARIOS, train, train_all

from lockstep.testing import run_ranks

SINGLE_PROCESS_ATOL = 1e-5
WORLD4_ATOL = 1e-6


def _close(a: dict, b: dict, atol: float | None, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        x, y = a[name], b[name]
        if x is None or y is None:
            assert x is None and y is None, f"{what}: {name} is None on one side only"
        elif atol is None:
            assert torch.equal(x, y), f"{what}: {name} differs by {(x - y).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=f"{what}: {name}")


FOUR_RANKS = pytest.param(4, marks=pytest.mark.slow)  # make test, not the inner loop


@pytest.fixture(scope="module", params=[1, 2, FOUR_RANKS], ids=lambda n: f"world{n}")
def runs(request):
    world = request.param
    return world, run_ranks(train_all, world, deadline_s=240, timeout_s=60)


def test_all_ranks_hold_identical_parameters(runs):
    world, results = runs
    for key in results[0]:
        for rank in range(1, world):
            _close(
                results[rank][key]["params"],
                results[0][key]["params"],
                None,
                f"{key} rank {rank} vs rank 0",
            )


@pytest.mark.parametrize("other", ["naive", "torch"])
def test_lockstep_matches_naive_and_torch_ddp(runs, other):
    world, results = runs
    atol = None if world <= 2 else WORLD4_ATOL
    for s in SCENARIOS:
        if (s.name, other) not in results[0]:
            continue
        ours, theirs = results[0][(s.name, "lockstep")], results[0][(s.name, other)]
        _close(ours["params"], theirs["params"], atol, f"{s.name}: params vs {other}")
        if other == "torch":
            _close(ours["grads"], theirs["grads"], atol, f"{s.name}: grads vs torch")
            _close(ours["buffers"], theirs["buffers"], atol, f"{s.name}: buffers vs torch")


@pytest.mark.parametrize("engine", ["lockstep", "naive"])
def test_data_parallel_matches_one_process_on_global_batch(runs, engine):
    """K steps at world size N with batch B/N per rank == one process with batch B."""
    _, results = runs
    for s in SCENARIOS:
        if s.model == "batchnorm" or s.sometimes_on_rank0:
            continue  # batch statistics / rank-dependent graphs have no single-process twin
        single = train("single", s)
        _close(
            results[0][(s.name, engine)]["params"],
            single["params"],
            SINGLE_PROCESS_ATOL,
            f"{s.name}: {engine} params vs one process",
        )


def test_frozen_weights_never_travel_and_bucket_caps_apply(runs):
    _, results = runs
    frozen = results[0][("frozen", "lockstep")]
    assert frozen["payload_bytes"] == (16 * 4 + 4) * 4  # the adapter's weight and bias only
    tiny = results[0][("tiny_buckets", "lockstep")]["buckets"]
    assert len(tiny) == 6 and all(len(b) == 1 for b in tiny)
    assert len(results[0][("one_bucket", "lockstep")]["buckets"]) == 1
    assert results[0][("tied", "lockstep")]["payload_bytes"] == (16 + 16 + 4) * 4
