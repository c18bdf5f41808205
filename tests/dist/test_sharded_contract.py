"""The DDP contract, kept by the sharded engine: errors on every rank, shards, frozen, state dicts.

Bad input (a stage outside 1..3, a wrap class matching nothing, ranks holding
different models or passing different stages) must raise the same clear error
on every rank, never hang. `parameters()` yields this rank's shards, so an
unchanged AdamW keeps 1/N of the state; frozen parameters never travel and
never change; the full state dict has the plain module's keys and loads into
the plain model (same outputs, bitwise) and into lockstep's DDP.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import MLP, PartlyFrozen
from sharded_cases import Block, TinyGPT, build, global_batches, loss_of
from torch import nn

import lockstep
from lockstep.errors import RankMismatchError
from lockstep.testing import run_ranks


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except (ValueError, RankMismatchError) as error:
        return type(error).__name__, str(error)
    return None


def _bad_inputs(ctx) -> dict:
    gpt = TinyGPT
    return {
        "stage0": _error(lambda: lockstep.ShardedDataParallel(gpt(), stage=0)),
        "stage_true": _error(lambda: lockstep.ShardedDataParallel(gpt(), stage=True)),
        "wrap_nothing": _error(lambda: lockstep.FSDP(gpt(), wrap=[nn.GRU])),
        "wrap_stage2": _error(lambda: lockstep.ShardedDataParallel(gpt(), stage=2, wrap=[Block])),
        "stages_differ": _error(
            lambda: lockstep.ShardedDataParallel(gpt(), stage=3 if ctx.rank == 0 else 2)
        ),
        "models_differ": _error(
            lambda: lockstep.ShardedDataParallel(MLP(16 if ctx.rank == 0 else 12), stage=3)
        ),
        "one_rank_bad": _error(
            lambda: lockstep.ShardedDataParallel(gpt(), stage=4 if ctx.rank == 1 else 3)
        ),
    }


def test_bad_input_raises_on_every_rank():
    results = run_ranks(_bad_inputs, 2, deadline_s=120, timeout_s=30)
    expect = {
        "stage0": ("ValueError", "stage must be 1, 2 or 3; found 0"),
        "stage_true": ("ValueError", "stage must be 1, 2 or 3; found True"),
        "wrap_nothing": ("ValueError", "wrap=['GRU'] matches no submodule of TinyGPT"),
        "wrap_stage2": ("ValueError", "wrap applies to stage 3 only"),
        "stages_differ": ("ValueError", "rank(s) [1] passed"),
        "models_differ": ("RankMismatchError", "rank(s) [1] differ"),
        "one_rank_bad": ("ValueError", "on rank 1: stage must be 1, 2 or 3; found 4"),
    }
    for rank, outcome in enumerate(results):
        for case, (kind, text) in expect.items():
            assert outcome[case] is not None, f"{case}: nothing raised on rank {rank}"
            assert outcome[case][0] == kind, f"{case} on rank {rank}: {outcome[case]}"
            assert text in outcome[case][1], f"{case} on rank {rank}: {outcome[case][1]}"
            assert f"rank {rank}" in outcome[case][1], "the message names the raising rank"


def _shards_and_frozen(ctx, stage: int) -> dict:
    torch.manual_seed(0)
    model = lockstep.ShardedDataParallel(PartlyFrozen(), stage=stage)
    frozen = ("base.weight", "base.bias")
    before = {k: v for k, v in model.state_dict().items() if k in frozen}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for x, y in global_batches("frozen", 2):
        loss_of("frozen", model, (x.chunk(2)[ctx.rank], y.chunk(2)[ctx.rank])).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    after = model.state_dict()
    trainable = sum(p.numel() for p in PartlyFrozen().adapter.parameters())
    return {
        "shard_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "state_numel": sum(
            v.numel() for s in opt.state.values() for v in s.values() if v.dim() == 1
        ),
        "trainable": trainable,
        "frozen_same": all(torch.equal(v, after[k]) for k, v in before.items()),
        "frozen_grads": [p.grad for p in model.parameters() if not p.requires_grad],
        "reduced_names": [n for f in model.grad_sync.flats for s in f.slots for n in s.names],
    }


def _per_stage(ctx, fn) -> dict:
    return {stage: fn(ctx, stage) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def shards_and_frozen():
    return run_ranks(_per_stage, 2, _shards_and_frozen, deadline_s=120, timeout_s=30)


@pytest.fixture(scope="module")
def state_dicts():
    return run_ranks(_per_stage, 2, _state_dicts, deadline_s=120, timeout_s=30)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_sees_shards_and_frozen_parameters_never_travel(shards_and_frozen, stage):
    for out in (rank[stage] for rank in shards_and_frozen):
        half = -(-out["trainable"] // 2)
        assert out["shard_numel"] == half, "parameters() must yield this rank's shard only"
        assert out["state_numel"] == 2 * half, "AdamW must hold 1/N of the state"
        assert out["frozen_same"], "a frozen parameter changed"
        assert out["frozen_grads"] and all(g is None for g in out["frozen_grads"])
        assert out["reduced_names"] == ["adapter.weight", "adapter.bias"]


def _state_dicts(ctx, stage: int) -> dict:
    model = lockstep.ShardedDataParallel(
        build("gpt"), stage=stage, wrap=[Block] if stage == 3 else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (idx,) = global_batches("gpt", 1)[0]
    loss_of("gpt", model, (idx.chunk(2)[ctx.rank],)).backward()
    opt.step()
    full = model.state_dict()
    plain = TinyGPT()
    plain.load_state_dict(full)
    ddp = lockstep.DDP(TinyGPT())
    ddp.load_state_dict(full)
    torch.manual_seed(5)
    other = lockstep.ShardedDataParallel(TinyGPT(), stage=stage)
    other.load_state_dict(full)
    with torch.no_grad():
        return {
            "keys": list(full),
            "plain_keys": list(TinyGPT().state_dict()),
            "sharded_out": model(idx[:, :-1]),
            "plain_out": plain(idx[:, :-1]),
            "ddp_out": ddp(idx[:, :-1]),
            "reloaded": all(torch.equal(other.state_dict()[k], v) for k, v in full.items()),
        }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_state_dict_loads_into_plain_model_and_ddp(state_dicts, stage):
    for out in (rank[stage] for rank in state_dicts):
        assert out["keys"] == out["plain_keys"], "plain module's keys, in its order"
        assert torch.equal(out["sharded_out"], out["plain_out"])
        assert torch.equal(out["sharded_out"], out["ddp_out"])
        assert out["reloaded"], "load_state_dict then state_dict gives the same tensors back"
