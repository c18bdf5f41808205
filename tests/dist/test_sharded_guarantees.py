"""The sharded engine keeps DDP's guarantees: it runs its backward through the same driver.

Two real gloo ranks, a tiny model, each stage where it matters. As for DDP:
no_sync() on one rank only is named at its first step on every rank (the step
fingerprint); a rank that pauses before its backward is named by the waiting
rank's stall inspector; every synchronised step leaves `StepStats` (one bucket
per flat) for observers, the Monitor and LOCKSTEP_TRACE; torch's
`require_backward_grad_sync = False` (nanoGPT's accumulation idiom) skips the
collectives exactly as `no_sync()` does, bitwise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.errors import RankMismatchError
from lockstep.runtime import waits
from lockstep.testing import run_ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _model(stage: int) -> lockstep.ShardedDataParallel:
    torch.manual_seed(0)
    net = nn.Sequential(Block(), Block(), nn.Linear(6, 2))
    wrap = [Block] if stage == 3 else None
    caps = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}
    return lockstep.ShardedDataParallel(net, stage=stage, wrap=wrap, **caps)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _uneven_no_sync(ctx, stage: int) -> dict:
    model = _model(stage)
    try:
        if ctx.rank == 0:  # an extra micro-batch on rank 0 only
            with model.no_sync():
                model(_batch(ctx.rank, 0)).sum().backward()
        model(_batch(ctx.rank, 1)).sum().backward()
    except RankMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def test_no_sync_on_one_rank_only_is_named_on_every_rank():
    # Stage 2: no_sync() runs no collective (stage 3's forward gathers would hang first).
    for result in run_ranks(_uneven_no_sync, 2, 2, deadline_s=120):
        assert result["error"] is not None, result
        assert "accumulated different numbers of micro-batches" in result["error"]
        assert "rank 0: step 1, data pass 0, 2 micro-batch(es)" in result["error"]


def _uneven_passes(ctx) -> dict:
    """Rank 0's loader holds two batches per pass, rank 1's one: step 2 pairs passes 1 and 2."""
    model = _model(3)
    data = TensorDataset(torch.randn(8, 6, generator=torch.Generator().manual_seed(ctx.rank)))
    loader = DataLoader(data, batch_size=4 * (ctx.rank + 1))
    batches = iter(loader)
    try:
        for _ in range(2):
            x = next(batches, None)
            if x is None:  # rank 1 restarts its loader: a second pass
                batches = iter(loader)
                x = next(batches)
            model(x[0][:4]).sum().backward()
    except RankMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def test_uneven_passes_over_the_data_are_named_under_stage_3():
    for result in run_ranks(_uneven_passes, 2, deadline_s=120):
        assert result["error"] is not None, result
        assert "different passes over their data" in result["error"]
        assert "rank 0: step 2, data pass 1" in result["error"], result
        assert "rank 1: step 2, data pass 2" in result["error"], result


def _pause_rank1(ctx, stage: int, before: str, pause_s: float) -> str:
    model = _model(stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if ctx.rank == 1 and step == 2 and before == "forward":
            time.sleep(pause_s)
        loss = model(_batch(ctx.rank, step)).sum()
        if ctx.rank == 1 and step == 2 and before == "backward":
            time.sleep(pause_s)
        loss.backward()
        opt.step()
    return waits.inspector().last_message


@pytest.mark.slow  # each waits out a stall warning: make test, not the inner loop
@pytest.mark.parametrize(
    ("stage", "before", "what"),
    [
        (1, "backward", "gradient bucket 0 of step 3"),
        (2, "forward", "parameter all-gather"),
        (3, "backward", "all-gather of unit"),
    ],
)
def test_a_waiting_rank_names_the_paused_rank(stage, before, what):
    env = {"LOCKSTEP_STALL_WARN_S": "0.4"}
    message = run_ranks(_pause_rank1, 2, stage, before, 2.5, env=env, deadline_s=120)[0]
    assert "[rank 0]: waited" in message and what in message, message
    assert "rank(s) 1 have not launched it" in message, message


def _observed(ctx, stage: int, trace_dir: str) -> dict:
    os.environ["LOCKSTEP_TRACE"] = trace_dir
    model = _model(stage)
    del os.environ["LOCKSTEP_TRACE"]
    seen: list[int] = []
    model.add_step_observer(lambda stats: seen.append(stats.step))
    monitor = lockstep.Monitor(model, ctx, log_every=1, straggler_every=2, progress=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        with model.no_sync():
            model(_batch(ctx.rank, 10 + step)).sum().backward()  # no step for observers
        loss = model(_batch(ctx.rank, step)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metrics = monitor.step(loss, batch_size=4)
    monitor.close()
    model.env_tracer.close()
    events = json.loads((Path(trace_dir) / f"trace_rank{ctx.rank}.json").read_text())
    traced = {e["args"]["step"] for e in events["traceEvents"] if "step" in e.get("args", {})}
    stats = model.stats
    return {
        "seen": seen,
        "traced": traced,
        "buckets": len(stats.buckets),
        "flats": sum(f.trainable for f in model.flats),
        "payload": stats.payload_bytes,
        "flat_bytes": sum(f.nbytes for f in model.flats if f.trainable),
        "synced": metrics.synced,
        "payload_metric": metrics.payload_bytes,
        "reports": len(monitor.reports),
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_step_stats_reach_observers_the_monitor_and_the_env_tracer(stage, tmp_path):
    results = run_ranks(_observed, 2, stage, str(tmp_path), deadline_s=120)
    for result in results:
        assert result["seen"] == [1, 2], result  # synchronised steps only
        assert {1, 2} <= result["traced"], result
        assert result["buckets"] == result["flats"] > 1, result
        assert result["payload"] == result["flat_bytes"] == result["payload_metric"], result
        assert result["synced"], result
        assert result["reports"] == 1, result  # the straggler window, exchanged at step 2


def _accumulate(ctx, stage: int, idiom: str) -> dict:
    model = _model(stage)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(3):
            last = micro == 2
            x = _batch(ctx.rank, 3 * step + micro)
            if idiom == "toggle":  # nanoGPT's spelling
                model.require_backward_grad_sync = last
                model(x).pow(2).mean().backward()
            elif last:
                model(x).pow(2).mean().backward()
            else:
                with model.no_sync():
                    model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {
        "steps": model.stats.step,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_require_backward_grad_sync_accumulates_like_no_sync(stage):
    toggled = run_ranks(_accumulate, 2, stage, "toggle", deadline_s=120)
    no_sync = run_ranks(_accumulate, 2, stage, "no_sync", deadline_s=120)
    for rank in range(2):
        assert toggled[rank]["steps"] == no_sync[rank]["steps"] == 2  # not 6
        for key, value in toggled[rank]["state"].items():
            assert torch.equal(value, no_sync[rank]["state"][key]), key


class _Reversed(nn.Module):
    """`a` is registered first but runs last, so its gradient is ready first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.b(x)))


def _launch_order(ctx) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    caps = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}
    model = lockstep.ShardedDataParallel(_Reversed(), stage=2, **caps)
    model(_batch(ctx.rank, 0)).sum().backward()
    return [(b.ready, b.launched) for b in model.stats.buckets]


def test_buckets_launch_in_index_order_whatever_order_gradients_arrive_in():
    for buckets in run_ranks(_launch_order, 2, deadline_s=120):
        ready, launched = zip(*buckets, strict=True)
        assert list(ready) != sorted(ready), buckets  # gradients arrived out of index order
        assert list(launched) == sorted(launched), buckets  # collectives did not
