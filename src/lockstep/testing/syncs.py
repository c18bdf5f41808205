"""Counting the host synchronisations of a training step, on a GPU and their stand-in on a CPU.

`count_cuda_syncs()` turns on torch's CUDA sync debug mode ("warn") and counts the
warnings it gives ("called a synchronizing CUDA operation"): a `.item()`, a
`.tolist()` or a blocking copy to or from the device, each a point where the host
waits for the GPU. Warnings from every thread count (autograd runs a CUDA
backward, and its hooks, on a thread of its own). `count_host_reads()` counts the
calls that read a tensor's value on the host (`item`, `tolist`, `bool`, `int`,
`float`): on a CPU nothing synchronises, but each of them would on a device.
torch's own warning says not every synchronisation is covered (not those inside
torch.distributed: a blocking `Work.wait()`), so both count what a script's Python
and the engine's do, which is what a change to the engine can add or remove.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"
READS = ("item", "tolist", "__bool__", "__int__", "__float__")


class SyncCount:
    """What one `count_cuda_syncs` block saw; `total` is final once the block has ended."""

    def __init__(self) -> None:
        self.total = 0
        self.places: Counter[str] = Counter()  # "file:line" of each synchronising call

    def add(self, caught: list[warnings.WarningMessage]) -> None:
        for warning in caught:
            if SYNC_WARNING in str(warning.message):
                self.total += 1
                self.places[f"{warning.filename}:{warning.lineno}"] += 1


@contextmanager
def count_cuda_syncs(enable_debug_mode: bool = True) -> Iterator[SyncCount]:
    """Count the CUDA synchronisations of the block (needs CUDA unless told not to set the mode).

    Args:
        enable_debug_mode: set torch.cuda's sync debug mode to "warn" for the block (and
            back to what it was); False only counts the warnings (a test without CUDA).

    Yields:
        The count, filled in when the block ends.
    """
    count = SyncCount()
    before = torch.cuda.get_sync_debug_mode() if enable_debug_mode else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every one counts, not the first per line
        if enable_debug_mode:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            if enable_debug_mode:
                torch.cuda.set_sync_debug_mode(before)
    count.add(caught)


@contextmanager
def count_host_reads() -> Iterator[Counter[str]]:
    """Count, by method, the calls of the block that read a tensor's value on the host.

    Yields:
        A Counter from "item", "tolist", "__bool__", "__int__", "__float__" to calls.
    """
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with lock:
                counts[name] += 1
            return original(self, *args, **kwargs)

        return read

    own = {name for name in READS if name in vars(torch.Tensor)}  # else inherited: deleted after
    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)


def count_a_settled_step(
    model: Any, optimizer: Any, generator: Any, steps: int = 3
) -> tuple[dict[str, int], int]:
    """Train `steps` steps on (4, 16) inputs; the last backward's host reads and
    `torch.distributed.all_reduce` calls (the first step's bucket rebuild is behind it).

    Returns:
        (host reads by kind, all-reduces issued during that backward).
    """
    import torch.distributed as dist

    all_reduce = dist.all_reduce
    calls = 0

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return all_reduce(*args, **kwargs)

    reads: Counter[str] = Counter()
    for step in range(steps):
        loss = model(torch.randn(4, 16, generator=generator)).pow(2).mean()
        if step == steps - 1:
            dist.all_reduce = counting
            try:
                with count_host_reads() as reads:
                    loss.backward()
            finally:
                dist.all_reduce = all_reduce
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(reads), calls
