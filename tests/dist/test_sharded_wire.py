"""Stages 2 and 3 send their theoretical bytes, and the step stats report what was sent.

Bytes are measured by the kernel, not by the engine: `/proc/self/io`'s `wchar`
counts every byte a process writes to its sockets (gloo's threads and the
communication thread included), read around `loss.backward()` of stage 2, whose
only collectives are the gradient reduce-scatters and the step fingerprint.
Theory for a reduce-scatter of G bytes over N ranks: (N-1)/N x G per rank
(gloo's own reduce-scatter is an all-reduce and sends 2(N-1)/N x G, which this
test would see). HSDP (2 x 2): (S-1)/S x G inside the shard group plus
2(R-1)/R x G/S across replicas. The step stats must equal the theory exactly and
the measured bytes within framing (headers and the fingerprint: under 2%).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import lockstep
from lockstep.testing import run_ranks

FRAMING = 1.02


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _measure(ctx, hybrid: bool) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    extra = {"hybrid": True, "shard_group_size": 2} if hybrid else {}
    model = lockstep.ShardedDataParallel(net, stage=2, bucket_cap_mb=0.2, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sent = []
    for step in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(10 * ctx.rank + step))
        loss = model(x).pow(2).mean()
        before = _wchar()
        loss.backward()
        sent.append(_wchar() - before)
        opt.step()
        opt.zero_grad()
    grad_bytes = sum(f.nbytes for f in model.flats if f.trainable)
    return {"sent": sent, "stats": model.stats.wire_bytes, "G": grad_bytes}


def _both(ctx) -> dict:
    return {"flat": _measure(ctx, False), "hybrid": _measure(ctx, True)}


def test_reduce_scatter_sends_its_theory_and_the_stats_say_so():
    for result in run_ranks(_both, 4, deadline_s=120):
        flat, hybrid = result["flat"], result["hybrid"]
        theory = {"flat": 3 * flat["G"] // 4, "hybrid": hybrid["G"] // 2 + hybrid["G"] // 2}
        for kind, out in (("flat", flat), ("hybrid", hybrid)):
            assert out["stats"] == theory[kind], (kind, out)
            for sent in out["sent"][1:]:  # the first step also sets up connections
                assert out["stats"] <= sent <= FRAMING * out["stats"], (kind, out)
