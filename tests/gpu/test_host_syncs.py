"""Host synchronisations per step on a GPU: lockstep's DDP against torch's, NCCL, world size 1.

torch's sync debug mode ("warn") flags each synchronising CUDA call of a step
(`lockstep.testing.syncs`); torch's DDP is the oracle. lockstep's may add exactly one
per step, and only with the non-finite check on (the default): the read of the
step's verdict at backward's end. At world size > 1 that same read brings the step
fingerprint, which carries the verdict. A fingerprint that believes it has a peer
runs the whole exchange over the one-rank NCCL group (the pinned copy, the
all-reduce, the read): still one. With the check off, none. Several buckets per
step, so a read per bucket would show. Skipped without CUDA; the counters are
checked on the CPU by tests/unit/test_syncs.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.runtime.fingerprint import StepFingerprint
from lockstep.testing.syncs import count_cuda_syncs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]

WARM, STEPS = 3, 4
VERDICT_READS = 1  # the one host read lockstep adds per step (docs/engine.md)


@pytest.fixture
def nccl_group():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrap(engine: str, mode: str, exchange: bool) -> nn.Module:
    torch.manual_seed(0)
    widths = [64, 128, 128, 128, 8]
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    model = nn.Sequential(*layers).cuda()
    caps = {"bucket_cap_mb": 0.02}  # three buckets
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[0], gradient_as_bucket_view=True, **caps
        )
    ddp = lockstep.DistributedDataParallel(
        model, device_ids=[0], nonfinite=mode, first_bucket_cap_mb=0.02, **caps
    )
    if exchange:  # the exchange of world size 2, over the one-rank group
        ddp.reducer.driver.fingerprint = StepFingerprint(None, 0, 2)
    return ddp


def _syncs_per_step(engine: str, mode: str = "raise", exchange: bool = False) -> dict:
    ddp = _wrap(engine, mode, exchange)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")

    def step() -> None:
        opt.zero_grad()
        (ddp(x) - y).pow(2).mean().backward()
        opt.step()

    for _ in range(WARM):  # the first steps rebuild the buckets (one broadcast and read)
        step()
    torch.cuda.synchronize()
    with count_cuda_syncs() as count:
        for _ in range(STEPS):
            step()
    buckets = len(ddp.reducer.buckets) if engine == "lockstep" else None
    return {"per_step": count.total / STEPS, "places": dict(count.places), "buckets": buckets}


def test_lockstep_adds_at_most_the_verdicts_read_per_step(nccl_group, record_property):
    theirs = _syncs_per_step("torch")
    ours = _syncs_per_step("lockstep")
    exchange = _syncs_per_step("lockstep", exchange=True)
    off = _syncs_per_step("lockstep", mode="off")
    counts = {"torch": theirs, "lockstep": ours, "exchange": exchange, "lockstep_off": off}
    for name, counted in counts.items():  # in junit.xml, and with pytest -rP on the screen
        record_property(f"syncs_per_step_{name}", counted["per_step"])
        print(f"{name}: {counted['per_step']} syncs per step at {counted['places']}")
    assert ours["buckets"] >= 3, ours  # the precondition: a read per bucket would show
    limit = theirs["per_step"] + VERDICT_READS
    assert ours["per_step"] <= limit, (ours, theirs)
    assert exchange["per_step"] <= limit, (exchange, theirs)
    assert off["per_step"] <= theirs["per_step"], (off, theirs)
