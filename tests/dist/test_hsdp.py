"""HSDP (`hybrid=True`): four gloo ranks as 2 "nodes" x 2, against torch's HSDP and flat stage 3.

Ranks {0, 1} and {2, 3} are the shard groups, {0, 2} and {1, 3} the replica
groups: torch's `fully_shard` on `init_device_mesh("cpu", (2, 2), mesh_dim_names=
("replicate", "shard"))` (it runs on gloo in torch 2.13). The arithmetic is the
same as torch's (gradients divided by 4, a sum of two in the shard group, a sum
of two across replicas: each order-free), so stages 2 and 3 must match it
bitwise with AdamW. Flat stage 3 adds the four addends in another order: 1e-6
absolute with SGD (as `test_sharded_parity.py` at world size 4; the losses to
1e-6 relative). Each rank holds
1/2 of the optimizer state, and the step stats count both levels' bytes.
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import Block, build, global_batches, loss_of, make_optimizer

import lockstep
from lockstep.errors import RankMismatchError
from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # four or compiled ranks: make test, not the inner loop

CAPS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}


def _policy(engine: str) -> dict:
    """`*_bf16` engines: bf16 compute, fp32 reduce (torch's policy class serves both)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not engine.endswith("_bf16"):
        return {}
    return {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}


def _torch_hsdp(model: torch.nn.Module, policy: dict) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, **policy)
    return fully_shard(model, mesh=mesh, **policy)


def _wrap(engine: str, name: str) -> torch.nn.Module:
    model, policy = build(name), _policy(engine)
    engine = engine.removesuffix("_bf16")
    if engine == "torch":
        return _torch_hsdp(model, policy)
    stage = int(engine[-1])
    hybrid = {"hybrid": True, "shard_group_size": 2} if engine.startswith("hsdp") else {}
    wrap = [Block] if stage == 3 and name == "gpt" else None
    return lockstep.ShardedDataParallel(model, stage=stage, wrap=wrap, **CAPS, **hybrid, **policy)


def _train(ctx, engine: str, name: str, optimizer: str) -> dict:
    model = _wrap(engine, name)
    opt = make_optimizer(optimizer, model)
    losses = []
    for batch in global_batches(name, 3):
        loss = loss_of(name, model, [t.chunk(ctx.world_size)[ctx.rank] for t in batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    state = model.state_dict()
    if engine.startswith("torch"):
        state = {k: v.full_tensor() for k, v in state.items()}
    out = {"losses": torch.stack(losses), "state": {k: v.clone() for k, v in state.items()}}
    if not engine.startswith("torch"):
        out["levels"] = dict(model.stats.wire_levels)
        out["wire"] = model.stats.wire_bytes
        out["flats"] = [(f.full.numel(), f.shard.numel()) for f in model.flats if f.trainable]
        out["optim"] = sum(v.numel() for s in opt.state.values() for v in s.values())
    return out


def _accumulate(ctx, idiom: str) -> dict:
    model = _wrap("hsdp3", "mlp")
    opt = make_optimizer("sgd", model)
    for batch in global_batches("mlp", 2):
        mine = [t.chunk(ctx.world_size)[ctx.rank] for t in batch]
        for i, part in enumerate(zip(*[t.chunk(2) for t in mine], strict=True)):
            if idiom == "toggle":
                model.require_backward_grad_sync = i == 1
                loss_of("mlp", model, part).backward()
            elif i == 1:
                loss_of("mlp", model, part).backward()
            else:
                with model.no_sync():
                    loss_of("mlp", model, part).backward()
        opt.step()
        opt.zero_grad()
    return {"steps": model.stats.step, "state": dict(model.state_dict())}


def _uneven_no_sync(ctx) -> str | None:
    model = _wrap("hsdp2", "mlp")
    x, y = global_batches("mlp", 1)[0]
    try:
        if ctx.rank == 3:  # an extra micro-batch on one rank of the second "node"
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.functional.mse_loss(model(x), y).backward()
    except RankMismatchError as error:
        return str(error)
    return None


def _resume(ctx) -> dict:
    """Train 2 steps, save the full states, load them into a fresh wrapper: step 3 alike."""
    batches = [[t.chunk(ctx.world_size)[ctx.rank] for t in b] for b in global_batches("gpt", 3)]
    model = _wrap("hsdp3", "gpt")
    opt = make_optimizer("adamw", model)
    for batch in batches[:2]:
        loss_of("gpt", model, batch).backward()
        opt.step()
        opt.zero_grad()
    saved = model.state_dict(), model.optimizer_state_dict(opt)
    again = _wrap("hsdp3", "gpt")
    again_opt = make_optimizer("adamw", again)
    again.load_state_dict(saved[0])
    again.load_optimizer_state_dict(again_opt, saved[1])
    out = []
    for wrapper, optimizer in ((model, opt), (again, again_opt)):
        loss_of("gpt", wrapper, batches[2]).backward()
        optimizer.step()
        out.append({k: v.clone() for k, v in wrapper.state_dict().items()})
    return {"continued": out[0], "resumed": out[1]}


def _everything(ctx) -> dict:
    out = {}
    for name in ("mlp", "gpt"):
        for engine in ("hsdp2", "hsdp3", "torch"):
            out[(name, engine, "adamw")] = _train(ctx, engine, name, "adamw")
        for engine in ("hsdp3", "stage3"):
            out[(name, engine, "sgd")] = _train(ctx, engine, name, "sgd")
    for engine in ("hsdp2_bf16", "hsdp3_bf16", "torch_bf16"):
        out[("gpt", engine, "adamw")] = _train(ctx, engine, "gpt", "adamw")
    out["toggle"], out["no_sync"] = _accumulate(ctx, "toggle"), _accumulate(ctx, "no_sync")
    out["resume"] = _resume(ctx)
    out["uneven"] = _uneven_no_sync(ctx)  # last: the mismatch ends the run
    return out


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_everything, 4, deadline_s=300, timeout_s=60)


def _equal(a: dict, b: dict, what: str) -> None:
    assert torch.equal(a["losses"], b["losses"]), f"{what}: losses {a['losses']} {b['losses']}"
    for key, value in b["state"].items():
        diff = (a["state"][key] - value).abs().max().item()
        assert torch.equal(a["state"][key], value), f"{what}: {key} differs by {diff:.3g}"


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("engine", ["hsdp2", "hsdp3"])
def test_hsdp_matches_torch_hsdp_bitwise(world4, name, engine):
    for rank, results in enumerate(world4):
        ref = results[(name, "torch", "adamw")]
        _equal(results[(name, engine, "adamw")], ref, f"{name} {engine} rank {rank}")


@pytest.mark.parametrize("engine", ["hsdp2_bf16", "hsdp3_bf16"])
def test_hsdp_with_a_bf16_policy_matches_torch_hsdp_with_it_bitwise(world4, engine):
    """bf16 compute, fp32 reduce: the policy's casts with HSDP's two-level reduce."""
    for rank, results in enumerate(world4):
        ours, ref = results[("gpt", engine, "adamw")], results[("gpt", "torch_bf16", "adamw")]
        _equal(ours, ref, f"gpt {engine} rank {rank}")
        plain = results[("gpt", engine.removesuffix("_bf16"), "adamw")]
        assert not torch.equal(ours["losses"], plain["losses"])  # the policy changed the run
        assert ours["levels"] == plain["levels"]  # fp32 reduce: the same bytes as fp32


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hsdp_matches_flat_stage_3(world4, name):
    for results in world4:
        ours, flat = results[(name, "hsdp3", "sgd")], results[(name, "stage3", "sgd")]
        # First that the run is hybrid at all (a wrapper ignoring hybrid=True would be flat
        # stage 3 itself): half the model per rank, and a replica all-reduce on the wire.
        assert all(2 * shard == full for full, shard in ours["flats"]), ours["flats"]
        assert ours["levels"].get("replica_all_reduce", 0) > 0, ours["levels"]
        for key, value in flat["state"].items():
            torch.testing.assert_close(ours["state"][key], value, atol=1e-6, rtol=0)
        # A loss near 12 has a float32 spacing near 1e-6: the losses are held relatively.
        torch.testing.assert_close(ours["losses"], flat["losses"], atol=1e-6, rtol=1e-6)


def test_shards_and_optimizer_state_are_half_of_the_model(world4):
    for results in world4:
        for name in ("mlp", "gpt"):
            hybrid, flat = results[(name, "hsdp3", "sgd")], results[(name, "stage3", "sgd")]
            assert all(2 * shard == full for full, shard in hybrid["flats"]), hybrid["flats"]
            assert all(4 * shard == full for full, shard in flat["flats"]), flat["flats"]
            assert hybrid["optim"] == 2 * flat["optim"]  # momentum: 1/2 against 1/4


def test_step_stats_count_both_levels(world4):
    for results in world4:
        for name in ("mlp", "gpt"):
            out = results[(name, "hsdp3", "adamw")]
            shard_bytes = sum(shard for _, shard in out["flats"]) * 4  # fp32
            # S = 2: one shard each way inside the group; R = 2: 2(R-1)/R x shard across.
            both = {"reduce_scatter": shard_bytes, "replica_all_reduce": shard_bytes}
            assert out["levels"] == both
            assert out["wire"] == 2 * shard_bytes
            flat = results[(name, "stage3", "sgd")]
            flat_shard = sum(shard for _, shard in flat["flats"]) * 4
            assert flat["levels"] == {"reduce_scatter": 3 * flat_shard}  # (N-1)/N, not 2(N-1)/N


def test_full_state_and_optimizer_state_resume_bitwise(world4):
    for rank, results in enumerate(world4):
        continued, resumed = results["resume"]["continued"], results["resume"]["resumed"]
        for key, value in continued.items():
            assert torch.equal(resumed[key], value), f"{key} rank {rank}"


def test_sync_toggle_and_fingerprint_hold(world4):
    for rank, results in enumerate(world4):
        toggled, no_sync = results["toggle"], results["no_sync"]
        assert toggled["steps"] == no_sync["steps"] == 2
        for key, value in no_sync["state"].items():
            assert torch.equal(toggled["state"][key], value), f"{key} rank {rank}"
        message = results["uneven"]
        assert message is not None and "accumulated different numbers of micro-batches" in message
        assert "rank 3: step 1, data pass 0, 2 micro-batch(es)" in message, message


def _pause(ctx, pause_s: float) -> str:
    import time

    from lockstep.runtime import waits

    model = _wrap("hsdp2", "mlp")
    opt = make_optimizer("sgd", model)
    for step, batch in enumerate(global_batches("mlp", 3)):
        loss = loss_of("mlp", model, [t.chunk(ctx.world_size)[ctx.rank] for t in batch])
        if ctx.rank == 3 and step == 2:
            time.sleep(pause_s)
        loss.backward()
        opt.step()
    return waits.inspector().last_message


def test_a_waiting_rank_names_the_paused_rank_across_groups():
    env = {"LOCKSTEP_STALL_WARN_S": "0.4"}
    messages = run_ranks(_pause, 4, 1.5, env=env, deadline_s=120)
    assert "[rank 0]: waited" in messages[0] and "gradient bucket" in messages[0], messages[0]
    assert "rank(s) 3 have not launched it" in messages[0], messages[0]


def _refused(ctx) -> list[str]:
    messages = []
    for stage, extra in (
        (1, {"hybrid": True, "shard_group_size": 1}),
        (3, {"hybrid": True, "shard_group_size": 3}),
        (3, {"shard_group_size": 1}),
    ):
        try:
            lockstep.ShardedDataParallel(build("mlp"), stage=stage, **extra)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_hybrid_arguments_raise_on_every_rank():
    for rank, messages in enumerate(run_ranks(_refused, 2, deadline_s=60)):
        assert len(messages) == 3, messages
        assert "hybrid sharding applies to stages 2 and 3" in messages[0]
        assert "must divide the world size 2; found 3" in messages[1]
        assert "applies to hybrid sharding; pass hybrid=True" in messages[2]
        assert all(f"(raised on rank {rank})" in m for m in messages), messages
