"""The step simulation against timelines worked out by hand, and its inputs (no processes).

Every case uses two parameters of 100 fp32 elements (400 bytes) and caps of 400
bytes, so each parameter is a bucket of its own; the link costs 1 s (or 2 s) per
bucket, so every time below is a small sum that can be checked on paper.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lockstep.observe.trace import TraceRecorder
from lockstep.plan.comm import Topology, two_phase_seconds
from lockstep.plan.links import NAMED_LINKS
from lockstep.plan.memory import Strategy
from lockstep.plan.profile import ParamTiming, StepProfile, profile_step
from lockstep.plan.profile_trace import profile_from_trace
from lockstep.plan.shape import LinearInfo
from lockstep.plan.simulate import engine_buckets, finish_time, simulate
from lockstep.plan.whatif import Route, lora_profile, predict
from lockstep.runtime.bucketing import assign_buckets, param_specs, trainable_parameters
from lockstep.runtime.step_stats import BucketRecord, StepStats

CAPS = {"first_cap_bytes": 400, "cap_bytes": 400}


def _profile(ready0: float, ready1: float) -> StepProfile:
    """forward 1 s, backward 4 s, optimizer 0.5 s; p0, p1 ready `ready0`, `ready1` into backward."""
    params = (
        ParamTiming("p0", 100, 4, "float32", ready0),
        ParamTiming("p1", 100, 4, "float32", ready1),
    )
    return StepProfile(params, 1.0, 4.0, 0.5, "hand")


def _run(profile: StepProfile, seconds: float, slowdown: float = 1.0, rebuilt: bool = True):
    layout = engine_buckets(profile, rebuilt=rebuilt, **CAPS)
    return layout, simulate(profile, layout, lambda nbytes: seconds * nbytes / 400, slowdown)


def test_hidden_communication_costs_nothing():
    # p1 ready 1 s into backward (t=2), p0 at t=4; each all-reduce 1 s: done at 3 and 5.
    layout, sim = _run(_profile(3.0, 1.0), 1.0)
    assert layout == [[1], [0]]  # rebuilt in ready order
    assert [(b.ready, b.started, b.done) for b in sim.buckets] == [(2, 2, 3), (4, 4, 5)]
    assert (sim.exposed_s, sim.step_s, sim.overlap, sim.critical_bucket) == (0, 5.5, 1.0, None)


def test_link_bound_chain_names_its_first_bucket():
    # 2 s per bucket: b0 2->4; b1 ready at 3.5 waits for the link, 4->6; 1 s exposed.
    _, sim = _run(_profile(2.5, 1.0), 2.0)
    assert [(b.launched, b.started, b.done) for b in sim.buckets] == [(2, 2, 4), (3.5, 4, 6)]
    assert sim.exposed_s == 1.0 and sim.step_s == 6.5 and sim.comm_s == 4.0
    assert sim.overlap == pytest.approx(1 - 1 / 4)  # 1 s exposed of a 4 s span (2 -> 6)
    assert sim.critical_bucket == 0


def test_slowdown_applies_only_while_backward_computes():
    # x2 during backward: b0 (1 s of work) 1.5 -> 3.5; b1 starts at 4 with 1 s of backward
    # left: half its work by 5, the other half at full speed: done at 5.5.
    _, sim = _run(_profile(3.0, 0.5), 1.0, slowdown=2.0)
    assert [b.done for b in sim.buckets] == [3.5, 5.5]
    assert sim.exposed_s == 0.5 and sim.step_s == 6.0
    assert sim.critical_bucket == 1  # the link was idle when it launched


def test_buckets_launch_in_index_order():
    # The first step buckets in reverse registration order: p1 first, ready only at t=4;
    # p0's bucket, ready at t=2, cannot launch before it.
    layout, sim = _run(_profile(1.0, 3.0), 1.0, rebuilt=False)
    assert layout == [[1], [0]]
    assert [(b.ready, b.launched, b.done) for b in sim.buckets] == [(4, 4, 5), (2, 4, 6)]
    assert sim.exposed_s == 1.0


def test_finish_time_pieces():
    assert finish_time(0.0, 1.0, 10.0, 3.0) == 3.0
    assert finish_time(9.0, 1.0, 10.0, 2.0) == 10.5
    assert finish_time(11.0, 1.0, 10.0, 2.0) == 12.0


def test_zero_strategies_use_half_rings_and_shard_the_optimizer():
    profile = _profile(3.0, 1.0)
    layout = engine_buckets(profile, **CAPS)
    cost = lambda nbytes: 1.0  # noqa: E731
    zero2 = predict(profile, layout, cost, 2, strategy=Strategy.ZERO2)
    # reduce-scatter 0.5 s each (hidden), optimizer 0.5 / 2, all-gather 2 x 0.5 after it.
    assert (zero2.exposed_s, zero2.optimizer_s, zero2.tail_s, zero2.step_s) == (0, 0.25, 1, 6.25)
    zero3 = predict(profile, layout, cost, 2, strategy=Strategy.ZERO3)
    assert zero3.step_s == 5.25  # forward hides the 1 s gather; the backward as DDP's


def test_engine_buckets_are_the_engines_function_in_ready_order():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    named = trainable_parameters(model)
    ready = [0.4, 0.5, 0.2, 0.3, 0.0, 0.1]  # reverse registration, biases before weights
    params = tuple(
        ParamTiming(n, p.numel(), 4, "float32", r) for (n, p), r in zip(named, ready, strict=True)
    )
    profile = StepProfile(params, 0.1, 0.6, 0.0, "hand")
    order = [4, 5, 2, 3, 0, 1]
    caps = {"first_cap_bytes": 10_000, "cap_bytes": 20_000}
    expected = assign_buckets(param_specs(named), order, **caps)
    assert engine_buckets(profile, **caps) == expected
    assert len(expected) > 1


def test_two_phase_route_is_the_planners_formula():
    nvlink, eth = NAMED_LINKS["nvlink"], NAMED_LINKS["ethernet"]
    cost = Route("x", "two-phase", nvlink, eth).bucket_seconds(64)
    expected = two_phase_seconds([25e6], Topology(8, 8), nvlink, eth, fast=False)
    assert cost is not None and cost(25e6) == expected
    assert Route("nvlink", "ring", nvlink, max_world=8).bucket_seconds(16) is None


def test_profile_records_backward_order_on_a_real_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profile = profile_step(model, lambda: (model(x), lambda y: y.sum()), opt, steps=2, warmup=1)
    ready = {p.name: p.ready_s for p in profile.params}
    assert [p.name for p in profile.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert 0 <= ready["2.weight"] <= ready["0.weight"] <= profile.backward_s
    assert profile.payload_bytes == 4 * (32 * 32 + 32 + 32 * 4 + 4)


def _stats(step: int, start: float) -> StepStats:
    buckets = (
        BucketRecord(0, 4000, 2, 0.030, 0.030, 0.050),
        BucketRecord(1, 9000, 3, 0.045, 0.050, 0.070),
    )
    return StepStats(step, 2, 0.010, 0.040, 13000, 13000, 0.040, 0.020, buckets, start)


def test_trace_profile_keeps_the_engines_buckets(tmp_path):
    recorder = TraceRecorder(tmp_path, rank=0, world_size=2)
    for step in (1, 2, 3):
        start = 100.0 + step
        recorder.record(
            SimpleNamespace(step=step),
            _stats(step, start),
            start,
            start + 0.08,
            (start + 0.07, start + 0.075),
        )
    recorder.write()
    profile = profile_from_trace(tmp_path)
    assert profile.prebucketed and [p.nbytes for p in profile.params] == [4000, 9000]
    assert profile.forward_s == pytest.approx(0.010)
    assert profile.backward_s == pytest.approx(0.040)
    assert profile.optimizer_s == pytest.approx(0.005)
    assert [p.ready_s for p in profile.params] == pytest.approx([0.020, 0.035])
    assert engine_buckets(profile) == [[0], [1]]
    with pytest.raises(ValueError, match="no step of rank 1"):
        profile_from_trace(tmp_path, rank=1)


def test_lora_profile_gives_adapters_their_base_layers_ready_time():
    params = (
        ParamTiming("q.weight", 64 * 32, 4, "float32", 0.3),
        ParamTiming("q.bias", 64, 4, "float32", 0.2),
        ParamTiming("k.weight", 64 * 32, 4, "float32", 0.1),
    )
    profile = StepProfile(params, 0.1, 0.5, 0.05, "hand")
    linears = (LinearInfo("q", 32, 64), LinearInfo("k", 32, 64))
    lora = lora_profile(profile, linears, 4, ["q"])
    assert lora is not None
    assert [(p.name, p.numel, p.ready_s) for p in lora.params] == [
        ("q.lora_A", 4 * 32, 0.3),
        ("q.lora_B", 64 * 4, 0.3),
    ]
    assert (lora.forward_s, lora.backward_s) == (0.1, 0.5)  # compute kept: an upper bound
    assert lora_profile(profile, linears, 4, ["v"]) is None
