"""CUDA stream order at the end of backward and in a comm hook's future (CUDA only).

1. What lockstep relies on (docs/engine.md, "Streams"): autograd runs the
   callback queued by `at_backward_end` on the stream current at the caller's
   `backward()`, not on the stream the gradient hook ran on.
2. A comm hook whose future is fulfilled on another stream before its kernels
   finish: the engine must order its copy of the value after them. A 50 ms GPU
   sleep on that stream makes the race certain if the wait were missing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_devices import NO_CUDA
from torch import nn

import lockstep
from lockstep.runtime.streams import at_backward_end, current_stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def test_callback_runs_on_the_callers_stream_not_the_hooks():
    side = torch.cuda.Stream()
    weight = torch.randn(256, 256, device="cuda", requires_grad=True)
    seen = {}

    def hook(param: torch.Tensor) -> None:
        if "hook" not in seen:
            seen["hook"] = current_stream(param.device)
            at_backward_end(lambda: seen.setdefault("end", current_stream(param.device)))

    weight.register_post_accumulate_grad_hook(hook)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # forward on the side stream: backward ops run there
        loss = (weight @ weight).sum()
    torch.cuda.current_stream().wait_stream(side)
    loss.backward()  # called from the default stream
    assert seen["hook"] == side
    assert seen["end"] == torch.cuda.current_stream()


def _late_hook(side: torch.cuda.Stream):
    def hook(state, bucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        side.wait_stream(torch.cuda.current_stream())
        fut = torch.futures.Future(devices=[buffer.device])
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # about 50 ms of GPU time before the value exists
            fut.set_result(buffer * 2)  # done() on the host at once; the kernel still queued
        return fut

    return hook


def test_hook_future_value_is_copied_after_its_kernels():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(512, 512).cuda()
        ddp = lockstep.DistributedDataParallel(model, device_ids=[0])
        ddp.register_comm_hook(None, _late_hook(torch.cuda.Stream()))
        x = torch.randn(64, 512, device="cuda")
        ddp(x).pow(2).mean().backward()
        expected = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
        for p, g in zip(model.parameters(), expected, strict=True):
            assert torch.equal(p.grad, g * 2)
    finally:
        dist.destroy_process_group()
