"""Rank bodies of tests/gpu/test_sharded_devices.py, parametrised on the device.

Each runs on two gloo ranks (`lockstep.testing.run_ranks`); with "cuda" both
ranks hold CUDA tensors on the one GPU. Results come back on the CPU.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import lockstep
from lockstep.errors import RankMismatchError
from lockstep.runtime import waits
from lockstep.testing.mesh import device_mesh


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    """An embedding, two blocks and a head: units for stage 3 and FSDP2."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _use_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)


def wrap(engine: str, model: nn.Module) -> nn.Module:
    if engine == "ddp":
        return lockstep.DistributedDataParallel(model)
    if engine == "fsdp2":  # an explicit mesh: the accelerator's would not fit a CPU model
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh(next(model.parameters()).device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    stage = int(engine.removeprefix("stage"))
    return lockstep.ShardedDataParallel(
        model, stage=stage, wrap=[Block] if stage == 3 else None, bucket_cap_mb=0.002
    )


def _full_state(engine: str, model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if engine == "fsdp2":
        return {k: _full_on_cpu(v) for k, v in state.items()}
    return {k: v.detach().cpu() for k, v in state.items()}


def _full_on_cpu(value: torch.Tensor) -> torch.Tensor:
    """FSDP2's parameter, whole, on the CPU: its dim-0 shards gathered as objects.

    Not `DTensor.full_tensor()`: on gloo with CUDA tensors (torch 2.11) its functional
    all-gather dies with SIGSEGV (seen on an H100, in torch's `_functional_collectives`).
    """
    import torch.distributed as dist

    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, value.to_local().detach().cpu())
    full = torch.cat(shards, dim=0)
    assert full.shape == value.shape, (full.shape, value.shape)
    return full


def train(ctx, engine: str, device: str, steps: int = 3) -> dict:
    """Train the stack with `engine`; losses and the full state on the CPU."""
    torch.manual_seed(0)
    model = wrap(engine, Stack().to(device))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        x, y = x.chunk(ctx.world_size)[ctx.rank].to(device), y.chunk(ctx.world_size)[ctx.rank]
        loss = (model(x).float() - y.to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return {"losses": torch.stack(losses), "state": _full_state(engine, model)}


def all_engines(ctx, device: str) -> dict:
    _use_device(device)
    return {e: train(ctx, e, device) for e in ("ddp", "stage1", "stage2", "stage3", "fsdp2")}


def checkpoint_round_trip(ctx, device: str, directory: str, engine: str) -> dict:
    """Save after two steps on `device`; restore onto `device` and onto the CPU."""
    _use_device(device)
    torch.manual_seed(0)
    model = wrap(engine, Stack().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(4, 16, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    checkpointer = lockstep.Checkpointer(directory, timeout_s=60)
    checkpointer.save(2, model=model, optimizer=opt)
    out = {"saved": saved}
    for target in (device, "cpu"):
        torch.manual_seed(1)  # other weights: the restore must overwrite them
        fresh = Stack().to(target)
        step = checkpointer.restore(model=fresh)
        out[target] = (step, {k: v.detach().cpu() for k, v in fresh.state_dict().items()})
        out[target + "_device"] = str(next(fresh.parameters()).device.type)
    return out


def stall_and_fingerprint(ctx, device: str) -> dict:
    """Rank 1 pauses before a backward (the stall watch names it), then rank 0 takes an
    extra no_sync micro-batch (the step fingerprint names both counts)."""
    _use_device(device)
    torch.manual_seed(0)
    ddp = lockstep.DistributedDataParallel(nn.Linear(8, 4).to(device))
    for step in range(3):
        if ctx.rank == 1 and step == 2:
            time.sleep(2.5)
        ddp(torch.randn(3, 8, device=device)).sum().backward()
    message = waits.inspector().last_message
    if ctx.rank == 0:
        with ddp.no_sync():
            ddp(torch.randn(3, 8, device=device)).sum().backward()
    try:
        ddp(torch.randn(3, 8, device=device)).sum().backward()
        mismatch = "no error"
    except RankMismatchError as error:
        mismatch = str(error)
    return {
        "stall": message,
        "mismatch": mismatch,
        "grad_device": ddp.module.weight.grad.device.type,
    }
