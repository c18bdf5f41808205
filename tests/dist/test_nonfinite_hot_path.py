"""The non-finite check's hot path reads nothing on the host per bucket and adds no collective.

Real gloo ranks, six buckets (tiny caps). Inside one synchronised step the calls that
read a tensor's value on the host (`item`, `tolist`, `bool`, ...: on a GPU each is a
synchronisation) and the all-reduces are counted, with the check on (the default) and
off. At world size 2 both counts must be equal: the verdict travels in the step
fingerprint, read once with it. At world size 1 (no fingerprint exchange) the check
reads its verdict once per step, and nothing more. The same counts on a GPU, with
torch's sync debug mode and torch's DDP as the oracle: tests/gpu/test_host_syncs.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.testing import run_ranks
from lockstep.testing.syncs import count_host_reads

CAPS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.001}


def _wrap(engine: str, mode: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    if engine == "ddp":
        ddp = lockstep.DistributedDataParallel(net, nonfinite=mode, **CAPS)
        return ddp, len(ddp.reducer.buckets)
    sharded = lockstep.ShardedDataParallel(net, stage=2, nonfinite=mode, **CAPS)
    return sharded, len(sharded.grad_sync.buckets)


def _counted_step(ctx, engine: str, mode: str) -> dict:
    """Three steps; the third one's host reads and all-reduces (after the one rebuild)."""
    model, buckets = _wrap(engine, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    calls: Counter[str] = Counter()
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        calls["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    reads: Counter[str] = Counter()
    for step in range(3):
        loss = model(torch.randn(4, 16, generator=gen)).pow(2).mean()
        if step == 2:
            dist.all_reduce = counting
            try:
                with count_host_reads() as reads:
                    loss.backward()
            finally:
                dist.all_reduce = all_reduce
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {"reads": dict(reads), "all_reduce": calls["all_reduce"], "buckets": buckets}


def _both_modes(ctx, engine: str) -> dict:
    return {mode: _counted_step(ctx, engine, mode) for mode in ("raise", "off")}


@pytest.mark.parametrize("engine", ["ddp", "sharded2"])
def test_the_check_reads_nothing_per_bucket_and_adds_no_collective(engine):
    for rank, result in enumerate(run_ranks(_both_modes, 2, engine, deadline_s=120)):
        on, off = result["raise"], result["off"]
        assert on["buckets"] >= 3, on  # the precondition: several buckets per step
        assert on["reads"] == off["reads"], (rank, on, off)
        assert on["all_reduce"] == off["all_reduce"], (rank, on, off)


def test_at_world_size_one_the_verdict_is_the_steps_one_read():
    result = run_ranks(_both_modes, 1, "ddp", deadline_s=60)[0]
    on, off = result["raise"], result["off"]
    assert on["buckets"] >= 3, on
    assert off["reads"] == {}, off
    assert on["reads"] == {"item": 1}, on
