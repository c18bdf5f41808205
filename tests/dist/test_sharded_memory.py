"""Per-rank memory of the model states, measured, against `lockstep plan`'s prediction.

After a training step (before zero_grad, when weights, gradients and optimizer
state are all held) each rank counts the bytes of the storages behind its
parameters, gradients and AdamW state (`plan/measured.py`), under DDP and each
stage, and compares them with the planner's per-GPU figure for the same model,
fp32, Adam and world size. Each of the three must be within 5%; the sharded
ones must also really be about 1/N of DDP's, so the test fails if nothing is sharded.
"""

from __future__ import annotations

import pytest
import torch
from sharded_cases import Block, build, global_batches, loss_of

import lockstep
from lockstep.plan.measured import measured_bytes, planned_bytes
from lockstep.sharded.timeline import Timeline
from lockstep.testing import run_ranks

TOLERANCE = 0.05


def _measure_all(ctx) -> dict:
    return {name: _measure(ctx, name) for name in ("gpt", "frozen")}


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_measure_all, 2, deadline_s=120, timeout_s=30)


def _measure(ctx, name: str) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        plain = build(name)
        predicted = planned_bytes(plain, ctx.world_size, stage)
        if stage == 0:
            model = lockstep.DDP(plain)
        else:
            model = lockstep.ShardedDataParallel(
                plain, stage=stage, wrap=[Block] if stage == 3 and name == "gpt" else None
            )
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        timeline = Timeline()
        for step, batch in enumerate(global_batches(name, 2)):
            if step == 1 and stage == 3:
                model.record_timeline(timeline)
            opt.zero_grad()
            loss_of(name, model, [t.chunk(ctx.world_size)[ctx.rank] for t in batch]).backward()
            opt.step()
        out[stage] = (measured_bytes(model, opt), predicted)
    out["lanes"] = [(s.lane, s.start <= s.end) for s in timeline.spans]
    return out


@pytest.mark.parametrize("name", ["gpt", "frozen"])
def test_measured_state_bytes_match_the_plan_within_5_percent(measured, name):
    for rank, result in enumerate(r[name] for r in measured):
        lanes = result.pop("lanes")
        for stage, (measured, predicted) in result.items():
            for part in ("weights", "grads", "optimizer"):
                got, want = getattr(measured, part), getattr(predicted, part)
                assert abs(got - want) <= TOLERANCE * want, (
                    f"{name} stage {stage} rank {rank} {part}: measured {got} B, plan {want} B"
                )
        ddp, full = result[0][0], result[3][0]
        kinds = {lane for lane, _ in lanes}
        assert kinds == {"compute", "all-gather", "reduce"} and all(ok for _, ok in lanes)
        assert full.total < 0.55 * ddp.total, "stage 3 must hold about half of DDP at N = 2"
