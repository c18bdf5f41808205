"""Engine behaviour beyond parity: agreement checks, unused-parameter errors, comm hooks, stats."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dropin_scenarios import STEP, float_all_reduces
from engine_models import MLP, WithUnused
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.profiler import ProfilerActivity, profile, record_function

import lockstep
from lockstep.engine.comm_hooks import (
    HookState,
    allreduce_mean_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from lockstep.engine.powersgd import PowerSGDState, powersgd_hook
from lockstep.errors import UnusedParametersError
from lockstep.runtime.bucket import GradBucket
from lockstep.testing import RankFailure, run_ranks


def _mismatched(ctx):
    width = 16 if ctx.rank == 0 else 12
    lockstep.DistributedDataParallel(MLP(width))


def test_parameter_mismatch_raises_on_every_rank_naming_parameter():
    with pytest.raises(RankFailure) as info:
        run_ranks(_mismatched, 2)
    assert info.value.failed_ranks == [0, 1]
    text = str(info.value)
    assert text.count("RankMismatchError") >= 2
    assert "rank(s) [1] differ" in text and "net.0.weight (16, 8)" in text


def _unused_without_flag(ctx):
    model = lockstep.DistributedDataParallel(WithUnused())
    x = torch.randn(4, 8)
    model(x).sum().backward()  # `never` and `sometimes` get no gradient
    try:
        model(x)
    except UnusedParametersError as error:
        return str(error)
    return None


def test_unused_parameters_make_next_forward_raise_on_every_rank():
    messages = run_ranks(_unused_without_flag, 2)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        assert f"on rank {rank}" in message
        assert "never.weight" in message and "sometimes.bias" in message
        assert "find_unused_parameters=True" in message


def _torch_bf16(state: object, bucket: GradBucket) -> torch.futures.Future:
    return default_hooks.bf16_compress_hook(state, bucket)


def _train_with_hook(ctx, engine: str, hook_name: str, steps: int = 4):
    torch.manual_seed(0)
    model = MLP(32)
    if engine == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        torch_hooks = {
            "fp16": default_hooks.fp16_compress_hook,
            "mean": default_hooks.allreduce_hook,
        }
        ddp.register_comm_hook(None, torch_hooks[hook_name])
        state = None
    else:
        ddp = lockstep.DistributedDataParallel(model)
        if hook_name == "torch-mean":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            state = None
        elif hook_name == "torch-bf16":  # torch's arithmetic, under another name: torch
            ddp.register_comm_hook(None, _torch_bf16)  # refuses its own name without NCCL
            state = None
        elif hook_name == "powersgd-full":
            state = PowerSGDState(rank=32, start_iter=0, min_compression_ratio=0.0)
            ddp.register_comm_hook(state, powersgd_hook)
        elif hook_name == "powersgd":
            state = PowerSGDState(rank=1, start_iter=1)
            ddp.register_comm_hook(state, powersgd_hook)
        elif hook_name != "none":
            hooks = {
                "fp16": fp16_compress_hook,
                "bf16": bf16_compress_hook,
                "mean": allreduce_mean_hook,
            }
            state = HookState()
            ddp.register_comm_hook(state, hooks[hook_name])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    losses, wire = [], []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        xs, ys = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        opt.zero_grad()
        loss = ((ddp(xs) - ys) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if engine == "lockstep":
            wire.append(ddp.stats.wire_bytes)
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "wire": wire, "losses": losses}


def _hooks_run(ctx):
    out = {}
    for engine, hook in [
        ("lockstep", "fp16"),
        ("torch", "fp16"),
        ("lockstep", "bf16"),
        ("lockstep", "torch-bf16"),
        ("lockstep", "mean"),
        ("lockstep", "none"),
        ("lockstep", "torch-mean"),
        ("lockstep", "powersgd-full"),
        ("lockstep", "powersgd"),
    ]:
        out[(engine, hook)] = _train_with_hook(ctx, engine, hook)
    return out


@pytest.fixture(scope="module")
def hook_runs():
    return run_ranks(_hooks_run, 2, deadline_s=120)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compression_hooks_match_torch_hooks_bitwise(hook_runs, hook):
    """fp16: against torch DDP with torch's hook; bf16: torch's hook on this engine."""
    oracle = ("torch", "fp16") if hook == "fp16" else ("lockstep", "torch-bf16")
    ours, theirs = hook_runs[0][("lockstep", hook)], hook_runs[0][oracle]
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(a, b)


def test_mean_hook_and_torch_hook_on_our_engine_equal_default(hook_runs):
    default = hook_runs[0][("lockstep", "none")]["params"]
    for hook in ["mean", "torch-mean"]:
        for a, b in zip(hook_runs[0][("lockstep", hook)]["params"], default, strict=True):
            assert torch.equal(a, b), hook


def test_full_rank_powersgd_equals_plain_average(hook_runs):
    default = hook_runs[0][("lockstep", "none")]["params"]
    for a, b in zip(hook_runs[0][("lockstep", "powersgd-full")]["params"], default, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def _ring_bytes(payload: float, world: int) -> float:
    """What each rank sends in a ring all-reduce of `payload` bytes, from the algorithm:
    N-1 chunks of payload/N to reduce-scatter the sums, then N-1 more to gather them.
    Written here, apart from the engine's figure, so that a wrong figure cannot pass."""
    chunk = payload / world
    return (world - 1) * chunk + (world - 1) * chunk


def test_wire_bytes_per_hook_against_theory(hook_runs):
    run = hook_runs[0]
    payload = sum(p.numel() for p in run[("lockstep", "none")]["params"]) * 4  # float32
    assert run[("lockstep", "none")]["wire"] == [_ring_bytes(payload, 2)] * 4 == [payload] * 4
    assert run[("lockstep", "fp16")]["wire"] == [_ring_bytes(payload / 2, 2)] * 4
    assert run[("lockstep", "bf16")]["wire"] == [_ring_bytes(payload / 2, 2)] * 4
    # PowerSGD rank 1 (from step 2): an n x m weight sends n + m numbers (each gains more
    # than the ratio 2: n m > 2 (n + m)); the biases go whole.
    weights = [(32, 8), (32, 32), (4, 32)]
    compressed = sum(n + m for n, m in weights)
    biases = 32 + 32 + 4
    expected = _ring_bytes((compressed + biases) * 4, 2)
    wire = run[("lockstep", "powersgd")]["wire"]
    assert wire[0] == _ring_bytes(payload, 2)  # start_iter=1: first step uncompressed
    assert wire[1:] == [expected] * 3
    assert expected < 0.5 * _ring_bytes(payload, 2)


def _portable_state_dict(ctx):
    torch.manual_seed(0)
    plain = MLP()
    ours = lockstep.DistributedDataParallel(MLP())
    theirs = nn.parallel.DistributedDataParallel(MLP())
    ours.load_state_dict(theirs.state_dict())  # `module.` prefix accepted
    plain.load_state_dict(ours.state_dict())  # our keys are the plain module's
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            plain.state_dict().values(), theirs.module.state_dict().values(), strict=True
        )
    )
    return list(ours.state_dict()) == list(MLP().state_dict()), same, ours.module is not None


def test_state_dict_is_portable():
    for keys_equal, values_equal, has_module in run_ranks(_portable_state_dict, 2):
        assert keys_equal and values_equal and has_module


def _stats(ctx):
    ddp = lockstep.DistributedDataParallel(MLP(64), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    for _ in range(3):
        ddp(torch.randn(8, 8)).sum().backward()
    return ddp.stats, ddp.payload_bytes


def _all_reduced_step(ctx):
    """One step of `_stats`'s model, and the all-reduces the backend ran, from its profiler."""
    ddp = lockstep.DistributedDataParallel(MLP(64), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=True) as prof, record_function(STEP):
        ddp(torch.randn(8, 8)).sum().backward()
    return ddp.stats, float_all_reduces(prof.events())[0]


def test_wire_bytes_at_three_ranks_are_four_thirds_of_the_gradients():
    """2(N-1)/N times the gradient bytes, counted from the model, at N = 3; the buckets
    the backend all-reduced (seen by torch's profiler) add up to those bytes."""
    grad_bytes = 4 * sum(p.numel() for p in MLP(64).parameters())  # float32
    for stats, all_reduced in run_ranks(_all_reduced_step, 3):
        assert 4 * sum(all_reduced) == stats.payload_bytes == grad_bytes
        assert len(all_reduced) == len(stats.buckets) >= 3
        assert abs(stats.wire_bytes - _ring_bytes(grad_bytes, 3)) < 1  # whole bytes
        assert abs(stats.wire_bytes - 4 / 3 * grad_bytes) < 1


def test_stats_describe_each_bucket_in_order():
    stats, payload = run_ranks(_stats, 2)[0]
    assert stats.step == 3 and stats.world_size == 2 and stats.payload_bytes == payload
    assert len(stats.buckets) >= 3
    for b in stats.buckets:
        assert 0 < b.ready <= b.launched <= b.done
    launches = [b.launched for b in stats.buckets]
    assert launches == sorted(launches)
    assert 0.0 <= stats.overlap <= 1.0
    assert stats.comm_seconds > 0 and stats.backward_seconds > 0


def _bad_args(ctx):
    errors = []
    for kwargs in [{"bucket_cap_mb": 0}, {"device_ids": [0, 1]}, {"device_ids": [0]}]:
        try:
            lockstep.DistributedDataParallel(MLP(), **kwargs)
        except ValueError as error:
            errors.append(str(error))
    frozen = MLP().requires_grad_(False)
    try:
        lockstep.DistributedDataParallel(frozen)
    except RuntimeError as error:  # torch's type
        errors.append(str(error))
    dist.barrier()
    return errors


def test_bad_arguments_get_clear_errors():
    errors = run_ranks(_bad_args, 1)[0]
    assert len(errors) == 4
    assert "must be positive" in errors[0]
    assert "exactly one device" in errors[1]
    assert "only to a module on one accelerator" in errors[2]  # a CPU module, as torch
    assert "requires grad" in errors[3]
