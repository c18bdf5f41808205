"""Per-unit reshard_after_forward and the policy's memory, measured against the plan.

Two gloo ranks train TinyGPT at stage 3 (one unit per block). A step's all-gathers
are counted from the timeline: the root once, each block twice (forward, then
again in backward) when it reshards, once when it is kept gathered; whatever
is kept, training is bitwise the same, and torch's `fully_shard(block,
reshard_after_forward=False)` agrees. Between forward and backward each rank
holds its shards plus the kept units in `param_dtype`; after a step, weights,
gradients and AdamW state under the bf16 policy (and, at stage 1, under a bf16
reduce with fp32 compute): both against `lockstep plan`
(`plan/measured.py`), within 5%.
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import Block, build, global_batches, loss_of

import lockstep
from lockstep.plan.measured import measured_bytes, planned_bytes, planned_gathered
from lockstep.sharded.timeline import Timeline
from lockstep.testing import run_ranks
from lockstep.testing.mesh import device_mesh

TOLERANCE = 0.05
POLICY = lockstep.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
REDUCE_ONLY = lockstep.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)  # fp32 compute
RULES = {"resharded": True, "kept": {Block: False}, "first": {"blocks.0": False}}


def _kept_params(plain: torch.nn.Module, rule_name: str) -> int:
    every = sum(p.numel() for p in plain.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in plain.blocks]
    root = every - sum(blocks)
    return {"resharded": root, "kept": every, "first": root + blocks[0]}[rule_name]


def _run(ctx, rule_name: str, policy, engine: str = "lockstep") -> dict:
    plain = build("gpt")
    kept = _kept_params(plain, rule_name)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh("cpu")  # explicit: the accelerator's would not fit a CPU model
        for block in plain.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=rule_name == "resharded")
        model = fully_shard(plain, mesh=mesh)
    else:
        model = lockstep.ShardedDataParallel(
            plain, stage=3, wrap=[Block], mp_policy=policy, reshard_after_forward=RULES[rule_name]
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timeline, out = Timeline(), {"losses": []}
    for step, batch in enumerate(global_batches("gpt", 2)):
        if step == 1 and engine == "lockstep":
            model.record_timeline(timeline)
        loss = loss_of("gpt", model, [t.chunk(ctx.world_size)[ctx.rank] for t in batch])
        if step == 1 and engine == "lockstep":
            out["forward"] = measured_bytes(model, opt).weights
            out["forward_plan"] = planned_bytes(build("gpt"), ctx.world_size, 3, policy).weights
            out["forward_plan"] += planned_gathered(build("gpt"), ctx.world_size, kept, policy)
        loss.backward()
        opt.step()
        out["losses"].append(loss.detach().float())
    if engine == "lockstep":
        out["gathers"] = sum(1 for s in timeline.spans if s.lane == "all-gather")
    state = model.state_dict()
    out["state"] = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in state.items()}
    return out


def _after_step(ctx, stage: int, policy=POLICY) -> tuple:
    model = lockstep.ShardedDataParallel(
        build("gpt"), stage=stage, wrap=[Block] if stage == 3 else None, mp_policy=policy
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in global_batches("gpt", 2):
        opt.zero_grad()
        loss_of("gpt", model, [t.chunk(ctx.world_size)[ctx.rank] for t in batch]).backward()
        opt.step()
    fulls = sum(f.full.untyped_storage().nbytes() for f in model.flats)
    planned = planned_bytes(build("gpt"), ctx.world_size, stage, policy)
    return measured_bytes(model, opt), planned, fulls


def _all(ctx) -> dict:
    out = {name: _run(ctx, name, POLICY) for name in RULES}
    out["fp32 resharded"] = _run(ctx, "resharded", None)
    out["fp32 kept"] = _run(ctx, "kept", None)
    out["fsdp2 kept"] = _run(ctx, "kept", None, "fsdp2")
    out["after"] = {stage: _after_step(ctx, stage) for stage in (1, 2, 3)}
    out["after"]["1 reduce-only"] = _after_step(ctx, 1, REDUCE_ONLY)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_all, 2, deadline_s=180, timeout_s=60)


def test_a_kept_unit_is_not_gathered_again_in_backward(world2):
    for rank, results in enumerate(world2):
        counts = {name: results[name]["gathers"] for name in RULES}
        assert counts == {"resharded": 5, "kept": 3, "first": 4}, f"rank {rank}: {counts}"
        for name in ("kept", "first"):
            for key, value in results["resharded"]["state"].items():
                assert torch.equal(results[name]["state"][key], value), f"{name} {key}"
        ours, theirs = results["fp32 kept"], results["fsdp2 kept"]
        assert torch.equal(torch.stack(ours["losses"]), torch.stack(theirs["losses"]))
        for key, value in theirs["state"].items():
            assert torch.equal(ours["state"][key], value), f"fsdp2 kept {key} rank {rank}"


@pytest.mark.parametrize("name", [*RULES, "fp32 resharded", "fp32 kept"])
def test_weights_between_forward_and_backward_match_the_plan(world2, name):
    for rank, results in enumerate(world2):
        got, want = results[name]["forward"], results[name]["forward_plan"]
        assert abs(got - want) <= TOLERANCE * want, f"{name} rank {rank}: {got} B, plan {want} B"


@pytest.mark.parametrize("stage", [1, 2, 3, "1 reduce-only"])
def test_policy_state_bytes_after_a_step_match_the_plan(world2, stage):
    for rank, results in enumerate(world2):
        measured, predicted, fulls = results["after"][stage]
        for part in ("weights", "grads", "optimizer"):
            got, want = getattr(measured, part), getattr(predicted, part)
            assert abs(got - want) <= TOLERANCE * want, (
                f"stage {stage} rank {rank} {part}: measured {got} B, plan {want} B"
            )
        numel = sum(p.numel() for p in build("gpt").parameters())
        expected = {3: 0, "1 reduce-only": numel * 4}.get(stage, numel * 2)  # the compute copy
        assert abs(fulls - expected) <= TOLERANCE * max(expected, 1) + 64, (stage, fulls)


def _refused(ctx) -> list[str]:
    errors = []
    cases = [
        ("gpt", {"stage": 3, "wrap": [Block], "reshard_after_forward": 3}),
        ("gpt", {"stage": 2, "reshard_after_forward": False}),
        ("frozen", {"stage": 2, "mp_policy": POLICY}),
    ]
    for name, kwargs in cases:
        try:
            lockstep.ShardedDataParallel(build(name), **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_unsupported_settings_raise_the_same_error_on_every_rank():
    errors = run_ranks(_refused, 2, deadline_s=60, timeout_s=20)
    assert errors[0] == [e.replace("rank 1)", "rank 0)") for e in errors[1]], errors
    wanted = ["a world of 3 ranks is not supported", "stage 3 only", "frozen ['base.weight'"]
    for error, text in zip(errors[0], wanted, strict=True):
        assert text in error, error
