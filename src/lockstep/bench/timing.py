"""The timing core every collective benchmark shares: `lockstep bench` and benchmarks/.

Two ways to time a collective, both reporting the slowest rank, since a
collective is over only when its last rank is done:
- `per_call_seconds`: each call behind a barrier, several candidates interleaved
  round by round (the starting candidate rotates), so drifting load on the
  machine hits them all alike; one sample per call.
- `back_to_back_seconds`: calls issued back to back after one barrier, the mean
  per call, as nccl-tests times its sweeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: list[float], device: torch.device = CPU) -> list[float]:
    """Element by element, the largest of the ranks' values (every rank gets the same)."""
    values = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def per_call_seconds(
    calls: Mapping[str, Callable[[], object]],
    iters: int,
    warmup: int,
    device: torch.device = CPU,
) -> dict[str, list[float]]:
    """Seconds of each call of each candidate, behind a barrier, slowest rank.

    Args:
        calls: candidate name -> a function that runs one collective.
        iters: timed calls per candidate.
        warmup: untimed rounds first (connections, buffers).
        device: where the collectives run (synchronised after each call).

    Returns:
        name -> `iters` samples in seconds.
    """
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + iters):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            sync(device)
            if round_ >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: slowest(samples[name], device) for name in names}


def back_to_back_seconds(
    call: Callable[[], object], iters: int, warmup: int, device: torch.device = CPU
) -> float:
    """Mean seconds per call of `iters` calls issued back to back, slowest rank."""
    for _ in range(warmup):
        call()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync(device)
    return slowest([(time.perf_counter() - start) / iters], device)[0]
