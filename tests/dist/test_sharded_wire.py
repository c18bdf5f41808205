"""Stages 2 and 3 send their theoretical bytes; the step stats and `lockstep plan` say so.

Bytes are measured by the kernel, not by the engine: `/proc/self/io`'s `wchar`
counts every byte a process writes to its sockets (gloo's threads and the
communication thread included). Four gloo ranks, flat and as 2 "nodes" x 2
(HSDP). Around `loss.backward()` of stage 2 (its only collectives are the
gradient reduce-scatters and the step fingerprint) the bytes must equal the step
stats within framing: theory (N-1)/N x G flat (gloo's own reduce-scatter is an
all-reduce and sends 2(N-1)/N x G, which this test would see); HSDP (S-1)/S x G
inside the shard group plus 2(R-1)/R x G/S across replicas. Over a whole
iteration (forward to forward: all-gathers included) the bytes must equal
`plan/hybrid.link_bytes`'s per-GPU figure of ZeRO-2/3 and HSDP-2/3 within framing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.plan.hybrid import link_bytes
from lockstep.testing import run_ranks

FRAMING = 1.02  # headers of gloo's messages and the step fingerprint


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _measure(ctx, stage: int, hybrid: bool) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(Block(), Block())  # every parameter inside a unit (stage 3)
    extra = {"hybrid": True, "shard_group_size": 2} if hybrid else {}
    extra.update({"wrap": [Block]} if stage == 3 else {"bucket_cap_mb": 0.2})
    model = lockstep.ShardedDataParallel(net, stage=stage, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backward, iteration = [], []
    for step in range(4):
        start = _wchar()
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(10 * ctx.rank + step))
        loss = model(x).pow(2).mean()
        before = _wchar()
        loss.backward()
        backward.append(_wchar() - before)
        opt.step()
        opt.zero_grad()
        iteration.append(_wchar() - start)
    grad_bytes = sum(f.nbytes // f.layout.padded_numel * f.layout.numel for f in model.flats)
    return {
        "backward": backward[1:],  # the first step also sets up connections
        "iteration": iteration[2:],  # stage 2 gathers the first update at step 2's forward
        "stats": model.stats.wire_bytes,
        "padded": sum(f.nbytes for f in model.flats if f.trainable),
        "G": grad_bytes,
    }


def _all(ctx) -> dict:
    return {(s, h): _measure(ctx, s, h) for s in (2, 3) for h in (False, True)}


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_all, 4, deadline_s=120)


def test_reduce_scatter_sends_its_theory_and_the_stats_say_so(world4):
    for result in world4:
        flat, hybrid = result[(2, False)], result[(2, True)]
        assert flat["stats"] == 3 * flat["padded"] // 4, flat  # (N-1)/N
        assert hybrid["stats"] == hybrid["padded"] // 2 + hybrid["padded"] // 2, hybrid
        for out in (flat, hybrid):
            for sent in out["backward"]:
                assert out["stats"] <= sent <= FRAMING * out["stats"], out


def test_plan_per_gpu_bytes_match_the_measured_iteration(world4):
    for result in world4:
        g = result[(2, False)]["G"]
        plan = {row.label: row.per_gpu for row in link_bytes(2, 2, g, g, g)}
        for key, label in {
            (2, False): "ZeRO-2",
            (2, True): "HSDP-2",
            (3, False): "ZeRO-3",
            (3, True): "HSDP-3",
        }.items():
            for sent in result[key]["iteration"]:
                assert plan[label] <= sent <= FRAMING * plan[label], (label, sent, plan[label])
