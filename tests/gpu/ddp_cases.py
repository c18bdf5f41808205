"""lockstep's DDP and torch's, trained side by side on one device; shared by tests/gpu.

`run_case(name, device, rank, world)` trains the same seeded model on the same
global batches (rank r takes the r-th slice) with each engine and returns
parameters and gradients on the CPU. The same bodies run on "cpu" (in CI: it
proves the test logic) and "cuda" (world size 1 over NCCL, or 2 over gloo with
CUDA tensors on one GPU). A case whose torch argument is newer than the installed
torch is skipped with that reason (`lockstep.testing.torch_features`). A case that
raises is recorded with its traceback and the run goes on: only its test fails.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.testing.torch_features import missing_ddp_arguments

STEPS = 3


class Net(nn.Module):
    """Two layers and a branch that may go unused (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.spare = nn.Linear(32, 64), nn.Linear(64, 8), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        return out + self.spare(h) if use_spare else out


@dataclass(frozen=True)
class Case:
    kwargs: dict[str, Any] = field(default_factory=dict)
    micro: int = 1
    toggle: bool = False  # accumulate with require_backward_grad_sync=False, not no_sync()
    amp: torch.dtype | None = None
    hook: str | None = None
    stream: str | None = None  # "both": forward+backward on a side stream; "forward": forward only
    spare_on_rank0: bool = False  # the spare branch only on rank 0, every other step
    cuda_only: bool = False


CASES: dict[str, Case] = {
    "plain": Case(),
    "bucket_view_off": Case({"gradient_as_bucket_view": False}),
    "no_sync": Case(micro=2),
    "require_backward_grad_sync": Case(micro=2, toggle=True),
    "amp_fp16_scaler": Case(amp=torch.float16, cuda_only=True),
    "amp_bf16_scaler": Case(amp=torch.bfloat16),
    "hook_fp16": Case(hook="fp16"),
    "hook_bf16": Case(hook="bf16"),
    "hook_powersgd": Case(hook="powersgd"),
    "static_graph": Case({"static_graph": True}),
    "find_unused": Case({"find_unused_parameters": True}, spare_on_rank0=True),
    "side_stream": Case(stream="both", cuda_only=True),
    "side_stream_forward": Case(stream="forward", cuda_only=True),
}


def skip_reason(name: str, device: str) -> str | None:
    """Why case `name` cannot run on `device` with the installed torch, or None."""
    case = CASES[name]
    if case.cuda_only and device != "cuda":
        return f"{name}: needs a CUDA device (side streams, fp16 GradScaler)"
    if case.hook == "bf16" and not torch.distributed.is_nccl_available():
        return f"{name}: torch's DDP takes bf16_compress_hook only where NCCL is built in"
    if case.hook == "powersgd" and device == "cpu" and torch.cuda.is_available():
        return (
            f"{name}: torch's PowerSGD hook calls torch.cuda.synchronize(device) whenever "
            "CUDA is available, which raises for CPU tensors (torch's own DDP too)"
        )
    missing = missing_ddp_arguments(case.kwargs)
    if missing:
        return f"{name}: torch {torch.__version__}'s DDP has no {', '.join(missing)}"
    return None


def _hook(name: str) -> tuple[Any, Callable]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )
    return state, powerSGD_hook.powerSGD_hook


def _wrap(engine: str, model: nn.Module, case: Case, device: str) -> nn.Module:
    kwargs = dict(case.kwargs)
    kwargs.setdefault("gradient_as_bucket_view", True)
    if device == "cuda":
        kwargs["device_ids"] = [torch.cuda.current_device()]
    torch_ddp = nn.parallel.DistributedDataParallel
    cls = lockstep.DistributedDataParallel if engine == "lockstep" else torch_ddp
    ddp = cls(model, **kwargs)
    if case.hook is not None:
        ddp.register_comm_hook(*_hook(case.hook))
    return ddp


def _batches(rank: int, world: int, micro: int, device: str) -> list[list[tuple]]:
    gen = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        n = 8 * world * micro
        x, y = torch.randn(n, 32, generator=gen), torch.randn(n, 8, generator=gen)
        mine = zip(
            x.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro), strict=True
        )
        steps.append([(a.to(device), b.to(device)) for a, b in mine])
    return steps


def _sync_context(ddp: nn.Module, case: Case, last: bool) -> Any:
    if last:
        return contextlib.nullcontext()
    if case.toggle:
        ddp.require_backward_grad_sync = False
        return contextlib.nullcontext()
    return ddp.no_sync()


def train(engine: str, name: str, device: str, rank: int, world: int) -> dict:
    """Train case `name` with `engine` ("lockstep" or "torch"); return CPU copies."""
    case = CASES[name]
    torch.manual_seed(0)
    model = Net().to(device)
    ddp = _wrap(engine, model, case, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device) if case.amp is not None else None
    side = torch.cuda.Stream() if case.stream else None
    grads: dict[str, torch.Tensor | None] = {}
    for step, micro in enumerate(_batches(rank, world, case.micro, device)):
        opt.zero_grad()
        for k, (x, y) in enumerate(micro):
            ddp.require_backward_grad_sync = True
            with _sync_context(ddp, case, k == len(micro) - 1):
                spare = not case.spare_on_rank0 or (rank == 0 and step % 2 == 0)
                _forward_backward(ddp, case, (x, y), scaler, side, spare)
        grads = {
            n: None if p.grad is None else p.grad.detach().cpu()
            for n, p in model.named_parameters()
        }
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return {"params": {n: p.detach().cpu() for n, p in model.named_parameters()}, "grads": grads}


def _forward_backward(ddp, case: Case, batch, scaler, side, spare: bool) -> None:
    x, y = batch
    amp = torch.autocast(x.device.type, dtype=case.amp) if case.amp else contextlib.nullcontext()
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    fwd = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
    with fwd, amp:
        loss = (ddp(x, use_spare=spare).float() - y).pow(2).mean()
    if case.stream == "forward":  # backward from the default stream, as torch documents
        torch.cuda.current_stream().wait_stream(side)
        fwd = contextlib.nullcontext()
    else:
        fwd = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
    with fwd:
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if side is not None and case.stream == "both":
        torch.cuda.current_stream().wait_stream(side)


def run_all(rank: int, world: int, device: str) -> dict:
    """Every runnable case with both engines: {(name, engine): result or {"error": text}}."""
    out = {}
    for name in CASES:
        if skip_reason(name, device) is None:
            for engine in ("lockstep", "torch"):
                try:
                    out[(name, engine)] = train(engine, name, device, rank, world)
                except Exception:  # the other cases still run; this one's test fails
                    out[(name, engine)] = {"error": traceback.format_exc()}
    return out


def rank_main(ctx, device: str) -> dict:
    """A rank of `lockstep.testing.run_ranks` (gloo); CUDA tensors on the one GPU."""
    if device == "cuda":
        torch.cuda.set_device(0)
    return run_all(ctx.rank, ctx.world_size, device)


def differences(ours: dict, theirs: dict) -> list[str]:
    """Names of the tensors that are not bitwise equal, with the largest difference."""
    found = []
    for part in ("params", "grads"):
        for key, a in ours[part].items():
            b = theirs[part][key]
            if (a is None) != (b is None):
                found.append(f"{part}.{key}: one is None")
            elif a is not None and not torch.equal(a, b):
                found.append(f"{part}.{key}: {(a.float() - b.float()).abs().max().item():.3g}")
    return found
