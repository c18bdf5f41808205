"""How a bucket's sum travels: the backend's native all-reduce, or one of lockstep's own.

`Transport.all_reduce(tensor)` starts a SUM all-reduce in place and returns a
`CollectiveHandle`. The native one is `torch.distributed.all_reduce(async_op=True)`.
The readable algorithms of `lockstep.collectives` are synchronous Python loops of
point-to-point operations, so they run on one dedicated communication thread,
in bucket order: backward goes on while they work, as with the native call. The
thread ends when the transport is collected, a group is destroyed, or the
interpreter exits (`runtime/threads.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.runtime.handles import CollectiveHandle, ThreadHandle, WorkHandle
from lockstep.runtime.threads import Worker

NATIVE = "native"


class Transport:
    """Starts in-place SUM all-reduces over `process_group` with the chosen algorithm.

    Args:
        process_group: the group of replicas; the default group when None.
        algorithm: "native", or a name that `lockstep.collectives.make_allreduce` knows.
        local_world_size: processes per node (used by the hierarchical algorithm).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        algorithm: str,
        local_world_size: int,
    ) -> None:
        self.process_group = process_group
        self.algorithm = algorithm
        self._custom: Callable[[torch.Tensor], None] | None = None
        self._thread: Worker | None = None
        if algorithm != NATIVE:
            from lockstep.collectives import make_allreduce

            self._custom = make_allreduce(algorithm, process_group, local_world_size)
            self._thread = Worker("lockstep-comm", owner=self)

    @property
    def inline(self) -> bool:
        """Whether `all_reduce` issues its collective on the calling thread (the native one)."""
        return self._thread is None

    def all_reduce(self, tensor: torch.Tensor) -> CollectiveHandle:
        """Start summing `tensor` over the group, in place; `wait()` the returned handle."""
        if self._thread is None:
            return WorkHandle(dist.all_reduce(tensor, group=self.process_group, async_op=True))
        return ThreadHandle(self._thread.submit(self._run_custom, tensor))

    def _run_custom(self, tensor: torch.Tensor) -> float:
        assert self._custom is not None
        self._custom(tensor)
        return time.perf_counter()
