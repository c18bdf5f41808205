"""Each ZeRO stage trains exactly like lockstep's DDP, and stage 3 like torch's fully_shard.

Every run trains the same seeded model on the same global batches (rank r takes
the r-th slice). At world size 2 the arithmetic is the same as DDP's (a sum of
two addends is order-free, 1/2 is exact, AdamW is elementwise on a flat shard
as on the parameters), so losses and final parameters must be bitwise equal;
so must stage 3 and torch FSDP2 (`fully_shard` per block and on the root). At
world size 4 a reduce-scatter adds four addends in another order than DDP's
all-reduce, so agreement is to 1e-6 absolute with SGD with momentum (AdamW's
normalisation would magnify a last-bit difference of a near-zero gradient up to
the learning rate). The global-norm clip (a different order of the squares)
is held to 1e-6 relative on the norm and 1e-6 absolute on the parameters.
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import MODELS, train

from lockstep.testing import run_ranks

STAGES = ("stage1", "stage2", "stage3")
WORLD4_ATOL = 1e-6
CLIP_ATOL = 1e-6


def _compare(ref: dict, out: dict, atol: float | None, what: str) -> None:
    assert list(out["state"]) == list(ref["state"]), f"{what}: state-dict keys differ"
    pairs = [("losses", out["losses"], ref["losses"])]
    pairs += [(k, out["state"][k], ref["state"][k]) for k in ref["state"]]
    for key, x, y in pairs:
        if atol is None:
            diff = (x.float() - y.float()).abs().max().item()
            assert torch.equal(x, y), f"{what}: {key} differs by {diff:.3g}"
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=f"{what}: {key}")


def _all_models(ctx, optimizer: str, micro: int) -> dict:
    out = {}
    for name in MODELS:
        for engine in ("ddp", *STAGES):
            out[(name, engine)] = train(ctx, engine, name, micro=micro, optimizer=optimizer)
        if ctx.world_size == 2 and name in ("mlp", "gpt", "tied"):
            out[(name, "fsdp2")] = train(ctx, "fsdp2", name, optimizer=optimizer)
    if ctx.world_size == 2:
        out.update(_accumulate_and_clip(ctx))
    return out


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_all_models, 2, "adamw", 1, deadline_s=300, timeout_s=60)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("stage", STAGES)
def test_stage_matches_ddp_bitwise_at_world_2(world2, name, stage):
    for rank, results in enumerate(world2):
        ref, out = results[(name, "ddp")], results[(name, stage)]
        _compare(ref, out, None, f"{name} {stage} vs DDP on rank {rank}")


@pytest.mark.parametrize("name", ["mlp", "gpt", "tied"])
def test_stage3_matches_torch_fully_shard_bitwise(world2, name):
    for rank, results in enumerate(world2):
        ref, out = results[(name, "fsdp2")], results[(name, "stage3")]
        _compare(ref, out, None, f"{name} stage3 vs torch fully_shard on rank {rank}")


@pytest.mark.slow
def test_stages_match_ddp_at_world_4():
    results = run_ranks(_all_models, 4, "sgd", 1, deadline_s=300, timeout_s=60)
    for name in MODELS:
        for stage in STAGES:
            ref, out = results[0][(name, "ddp")], results[0][(name, stage)]
            _compare(ref, out, WORLD4_ATOL, f"{name} {stage} vs DDP at world size 4")
        for rank in range(1, 4):  # every rank gathers the same full parameters
            theirs, ours = results[rank][(name, "stage3")], results[0][(name, "stage3")]
            for key, value in ours["state"].items():
                assert torch.equal(theirs["state"][key], value), f"{name} {key} rank {rank}"


def _accumulate_and_clip(ctx) -> dict:
    out = {}
    for engine in ("ddp", *STAGES):
        out[("no_sync", engine)] = train(ctx, engine, "gpt", micro=2)
        out[("clip", engine)] = train(ctx, engine, "gpt", clip=0.05, optimizer="sgd")
        out[("eval", engine)] = train(ctx, engine, "gpt", eval_forward=True)
    return out


def test_no_sync_and_eval_forward_bitwise_and_clip_grad_norm_global(world2):
    results = world2[0]
    for stage in STAGES:
        _compare(results[("no_sync", "ddp")], results[("no_sync", stage)], None, f"{stage}")
        _compare(results[("eval", "ddp")], results[("eval", stage)], None, f"eval {stage}")
        ref, out = results[("clip", "ddp")], results[("clip", stage)]
        assert ref["norms"].min() > 0.05, "the clip must actually clip"
        torch.testing.assert_close(out["norms"], ref["norms"], rtol=1e-6, atol=0)
        _compare(ref, out, CLIP_ATOL, f"clipped {stage}")
