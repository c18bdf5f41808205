"""How a bucket's sum travels: the backend's native all-reduce, or one of lockstep's own.

`Communicator.all_reduce(tensor)` starts a SUM all-reduce in place and returns a
handle with `wait()`. The native one is `torch.distributed.all_reduce(async_op=True)`.
The readable algorithms of `lockstep.collectives` are synchronous Python loops of
point-to-point operations, so they run on one dedicated communication thread,
in bucket order: backward goes on while they work, as with the native call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

NATIVE = "native"


class _Stamped:
    """A handle on a native all-reduce that notes when it was seen finished.

    No Python callback is attached to the backend's future: such a callback needs
    the GIL on the backend's own thread, which stalls the next all-reduce while
    backward holds the GIL, and may fire during interpreter shutdown. Instead the
    reducer polls `is_completed()` at each gradient hook, so the stamp is taken at
    the first hook (or the final wait) after completion: a close upper bound.
    """

    def __init__(self, work: dist.Work) -> None:
        self.work = work
        self.done_at = 0.0

    def poll(self) -> bool:
        """Stamp and return True if the all-reduce has finished."""
        if not self.done_at and self.work.is_completed():
            self.done_at = time.perf_counter()
        return bool(self.done_at)

    def wait(self) -> None:
        self.work.wait()
        if not self.done_at:
            self.done_at = time.perf_counter()


class _Threaded:
    """A handle on an all-reduce running on the communication thread."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.done_at = 0.0

    def poll(self) -> bool:
        if not self.done_at and self.future.done():
            self.done_at = self.future.result()
        return bool(self.done_at)

    def wait(self) -> None:
        self.done_at = self.future.result()


class Communicator:
    """Starts in-place SUM all-reduces over `process_group` with the chosen algorithm.

    Args:
        process_group: the group of replicas; the default group when None.
        algorithm: "native", or a name that `lockstep.collectives.make_allreduce` knows.
        local_world_size: processes per node (used by the hierarchical algorithm).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        algorithm: str = NATIVE,
        local_world_size: int = 1,
    ) -> None:
        self.process_group = process_group
        self.algorithm = algorithm
        self._custom: Callable[[torch.Tensor], None] | None = None
        self._thread: ThreadPoolExecutor | None = None
        if algorithm != NATIVE:
            from lockstep.collectives import make_allreduce

            self._custom = make_allreduce(algorithm, process_group, local_world_size)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="lockstep-comm")

    def all_reduce(self, tensor: torch.Tensor) -> _Stamped | _Threaded:
        """Start summing `tensor` over the group, in place; `wait()` the returned handle."""
        if self._custom is None:
            return _Stamped(dist.all_reduce(tensor, group=self.process_group, async_op=True))
        assert self._thread is not None
        return _Threaded(self._thread.submit(self._run_custom, tensor))

    def _run_custom(self, tensor: torch.Tensor) -> float:
        assert self._custom is not None
        self._custom(tensor)
        return time.perf_counter()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
