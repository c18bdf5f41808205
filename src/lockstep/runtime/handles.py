"""One protocol for "a collective in flight", whatever started it.

A bucket's collective may be the backend's own (a `dist.Work`), one of
lockstep's readable algorithms running on the communication thread (a
`concurrent.futures.Future`), or a communication hook's `torch.futures.Future`.
The driver sees only `CollectiveHandle`: `poll()` (finished yet?), `wait()`
(block until the bucket's buffer holds the result) and `done_at` (when it was
first seen finished, a `perf_counter()` reading; 0.0 before).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Protocol

import torch
import torch.distributed as dist


class CollectiveHandle(Protocol):
    """A bucket's collective in flight."""

    done_at: float

    def poll(self) -> bool:
        """Return True (and stamp `done_at`) once the collective has finished."""
        ...

    def wait(self) -> None:
        """Block until the result is in the bucket's buffer; stamp `done_at`."""
        ...


class WorkHandle:
    """The backend's own collective (`dist.Work`), polled rather than called back.

    No Python callback is attached to the backend's future: such a callback needs
    the GIL on the backend's own thread, which stalls the next collective while
    backward holds the GIL, and may fire during interpreter shutdown. Instead the
    driver polls `is_completed()` at each gradient hook, so the stamp is taken at
    the first hook (or the final wait) after completion: a close upper bound.
    """

    def __init__(self, work: dist.Work) -> None:
        self.work = work
        self.done_at = 0.0

    def poll(self) -> bool:
        if not self.done_at and self.work.is_completed():
            self.done_at = time.perf_counter()
        return bool(self.done_at)

    def wait(self) -> None:
        self.work.wait()
        if not self.done_at:
            self.done_at = time.perf_counter()


class ThreadHandle:
    """A collective running on the communication thread; its result is the finish time."""

    def __init__(self, future: Future[float]) -> None:
        self.future = future
        self.done_at = 0.0

    def poll(self) -> bool:
        if not self.done_at and self.future.done():
            self.done_at = self.future.result()
        return bool(self.done_at)

    def wait(self) -> None:
        self.done_at = self.future.result()


class HookHandle:
    """A communication hook's future; its value is copied into `buffer` unless it is it.

    torch's hooks return either the averaged buffer itself or a new tensor (a
    decompressed copy), sometimes wrapped in a one-element list (the value of a
    `dist.Work`'s future): `wait()` accepts all three.
    """

    def __init__(self, future: torch.futures.Future, buffer: torch.Tensor) -> None:
        self.future = future
        self.buffer = buffer
        self.done_at = 0.0

    def poll(self) -> bool:
        if not self.done_at and self.future.done():
            self._take()
        return bool(self.done_at)

    def wait(self) -> None:
        if not self.done_at:
            self.future.wait()
            self._take()

    def _take(self) -> None:
        # done() may be true while a CUDA future's kernels still run; wait() orders the
        # current stream after them (value() alone does not), so the copy below is safe.
        self.future.wait()
        result = self.future.value()
        result = result[0] if isinstance(result, list) else result
        if result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view_as(self.buffer))
        self.done_at = time.perf_counter()
