"""The engine on CUDA with NCCL: same numbers as torch DDP, gradients on the device.

Skipped where no CUDA device is visible (CI has none). World size 1 over NCCL,
one process: the device path, the NCCL stream and the bucket views are
exercised; multi-GPU parity runs the same code with more ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]


@pytest.fixture
def nccl_group():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(engine: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    if engine == "lockstep":
        model = lockstep.DistributedDataParallel(model, device_ids=[0])
    else:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[0], gradient_as_bucket_view=True
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen)  # on the CPU: device_ids moves it
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for p in model.parameters():
        assert p.grad is not None and p.grad.is_cuda
    return [p.detach().cpu() for p in model.parameters()]


def test_nccl_engine_matches_torch_ddp(nccl_group):
    ours, theirs = _train("lockstep"), _train("torch")
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def _train_amp(engine: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """autocast with a GradScaler, the usual GPU mixed-precision loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    cls = (
        lockstep.DistributedDataParallel
        if engine == "lockstep"
        else nn.parallel.DistributedDataParallel
    )
    ddp = cls(model, device_ids=[0], gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = ddp(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_with_grad_scaler_matches_torch_ddp(nccl_group, dtype):
    ours, theirs = _train_amp("lockstep", dtype), _train_amp("torch", dtype)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
