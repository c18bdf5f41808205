"""How much slower an all-reduce runs while every rank computes: the overlap slowdown.

In the engine, a bucket's all-reduce runs while backward still computes. On CPU
both compete for the same cores (gloo's threads against autograd's), so the
all-reduce takes longer than on an idle machine; on GPUs it runs on its own
copy engines and links. `measure_slowdown` times the same all-reduce idle and
while a thread on every rank multiplies matrices, interleaved call by call, and
returns the ratio of the medians. `lockstep plan --profile` applies it to the
communication that overlaps backward.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

import torch
import torch.distributed as dist

from lockstep.bench.timing import per_call_seconds

SLOWDOWN_BYTES = 4 * 2**20  # the size of a bucket that runs inside backward


class _Compute:
    """A thread that multiplies matrices while `busy` is set, until stopped."""

    def __init__(self, device: torch.device) -> None:
        self.busy, self.stop = threading.Event(), threading.Event()
        self.device = device
        self.thread = threading.Thread(target=self._run, name="lockstep-compute", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        a = torch.randn(192, 192, device=self.device)
        while not self.stop.is_set():
            if self.busy.wait(timeout=0.05):
                a = torch.tanh(a @ a)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def during(self, tensor: torch.Tensor) -> None:
        self.busy.set()
        try:
            dist.all_reduce(tensor)
        finally:
            self.busy.clear()


def measure_slowdown(
    device: torch.device, iters: int, warmup: int, nbytes: int = SLOWDOWN_BYTES
) -> dict[str, Any]:
    """All-reduce of `nbytes` (fp32) idle and while every rank computes: medians and ratio.

    Returns:
        {"factor": busy / idle (at least 1.0), "size_bytes", "idle_s", "busy_s"}.
    """
    tensor = torch.zeros(nbytes // 4, device=device)
    compute = _Compute(device)
    try:
        calls = {"idle": lambda: dist.all_reduce(tensor), "busy": lambda: compute.during(tensor)}
        times = per_call_seconds(calls, iters, warmup, device)
    finally:
        compute.close()
    idle, busy = statistics.median(times["idle"]), statistics.median(times["busy"])
    return {"factor": max(1.0, busy / idle), "size_bytes": nbytes, "idle_s": idle, "busy_s": busy}
