"""`Reducer`: the part of backward where data parallelism happens.

One post-accumulate-grad hook per parameter marks its gradient ready: the
gradient is scaled by 1/world_size into its slot of a bucket (or found there
already, with gradient_as_bucket_view, and divided with the whole bucket when it
is complete). When a bucket's last gradient arrives the bucket is complete, and
buckets are launched strictly in index order, so every rank issues the same
all-reduces in the same order. The first hook of a backward queues `_finalize`
on the autograd engine; it runs when autograd has no work left, waits for the
all-reduces and leaves averaged gradients in `.grad`.
After the first synchronised step the buckets are rebuilt once, in the order
gradients really became ready (rank 0's order, broadcast to all).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.bucket import Bucket, GradBucket
from lockstep.engine.bucketing import assign_buckets, param_specs
from lockstep.engine.comm import Communicator
from lockstep.engine.stats import StepMarks, StepStats, step_stats
from lockstep.errors import LockstepError, UnusedParametersError

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class Reducer:
    """Buckets, hooks and the per-step state machine of gradient synchronisation."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        comm: Communicator,
        *,
        first_cap_bytes: int,
        cap_bytes: int,
        find_unused: bool,
        gradient_as_bucket_view: bool,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.specs = param_specs(named_params)
        self.comm = comm
        self.group = comm.process_group
        self.world_size = dist.get_world_size(self.group)
        self.first_cap_bytes, self.cap_bytes = first_cap_bytes, cap_bytes
        self.find_unused = find_unused
        self.grad_as_view = gradient_as_bucket_view
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.steps = 0
        self.last_stats: StepStats | None = None
        self._expect_sync = False
        self._rebuilt = False
        self._ready_order: list[int] = []
        self._unfinished: str | None = None
        self._build(
            assign_buckets(self.specs, None, first_cap_bytes=first_cap_bytes, cap_bytes=cap_bytes)
        )
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------------- layout
    def _build(self, layout: list[list[int]]) -> None:
        self.layout = layout
        self.buckets = [
            Bucket.build(b, [self.params[i] for i in idx], idx, self.world_size)
            for b, idx in enumerate(layout)
        ]
        self._bucket_of: list[Bucket] = [self.buckets[0]] * len(self.params)
        self._view_of: list[torch.Tensor] = [self.buckets[0].buffer] * len(self.params)
        for bucket in self.buckets:
            for pos, i in enumerate(bucket.param_indices):
                self._bucket_of[i], self._view_of[i] = bucket, bucket.views[pos]
                grad = self.params[i].grad
                if self.grad_as_view and grad is not None:
                    bucket.views[pos].copy_(grad)
                    self.params[i].grad = bucket.views[pos]
        self._marked = [False] * len(self.params)

    def rebuild_if_needed(self) -> None:
        """Once, before the second synchronised forward: re-bucket in observed ready order."""
        if self._rebuilt or len(self._ready_order) != len(self.params):
            return
        order = torch.tensor(self._ready_order, dtype=torch.int64)
        if self.world_size > 1:
            dist.broadcast(
                order, dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
            )
        self._build(
            assign_buckets(
                self.specs,
                order.tolist(),
                first_cap_bytes=self.first_cap_bytes,
                cap_bytes=self.cap_bytes,
            )
        )
        self._rebuilt = True

    # ------------------------------------------------------------ each step
    def check_previous_step(self) -> None:
        """Raise, before a forward, if the previous backward left buckets unreduced."""
        if self._unfinished is not None:
            message, self._unfinished = self._unfinished, None
            raise UnusedParametersError(message)

    def prepare_for_backward(
        self, unused: list[int], forward_start: float, forward_end: float
    ) -> None:
        """Arm the hooks for a synchronised backward; `unused` are parameters to pre-mark."""
        self._expect_sync = True
        self._callback_queued = False
        self._scale = self.comm_hook is None and self.world_size > 1
        self._next_bucket = 0
        self._unused_to_mark = unused
        self._forward = (forward_start, forward_end)
        self._marked = [False] * len(self.params)
        self._used = [False] * len(self.params)
        self._without_grad: list[int] = []
        self._in_flight: list = []  # native all-reduces not yet seen finished, oldest first
        for bucket in self.buckets:
            bucket.reset()

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self._expect_sync:
                if not self._callback_queued:
                    self._start_backward()
                self._used[index] = True
                self._mark_ready(index, param)

        return hook

    def _start_backward(self) -> None:
        """At the first hook of a backward: queue finalize, pre-mark unused parameters."""
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for unused in self._unused_to_mark:
            self._mark_ready(unused, self.params[unused])

    def _mark_ready(self, index: int, param: torch.Tensor) -> None:
        """Put the gradient in its slot; launch the bucket if it was the last one missing.

        This is the hot path (once per parameter per step), so it stays flat. A
        copied gradient is scaled by 1/N while it is copied, as torch DDP does (one
        pass over the bytes); one found in place is divided with the rest of its
        bucket at launch (`Bucket.divide_found_in_place`), one kernel per bucket rather than
        per gradient. A comm hook averages itself.
        """
        if self._marked[index]:
            raise self._twice_error(index)
        self._marked[index] = True
        if not self._rebuilt:
            self._ready_order.append(index)
        view = self._view_of[index]
        bucket = self._bucket_of[index]
        grad = param.grad
        if grad is None:
            view.zero_()
            self._without_grad.append(index)
        elif grad.data_ptr() == view.data_ptr():
            if self._scale:
                bucket.found_in_place.append(view)
        else:
            if self._scale:  # one pass: scaled while copied, as torch DDP does
                torch.mul(grad, bucket.inv_world, out=view)
                bucket.scaled_copies += 1
            else:
                view.copy_(grad)
            if self.grad_as_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.times.ready = time.perf_counter()
            self._launch_ready_buckets()
        if self._in_flight:
            self._poll_in_flight()

    def _poll_in_flight(self) -> None:
        while self._in_flight and self._in_flight[0].poll():
            self._in_flight.pop(0)

    def _twice_error(self, index: int) -> LockstepError:
        return LockstepError(
            f"parameter {self.names[index]!r} became ready twice in one backward on rank "
            f"{dist.get_rank()}; expected once. This happens with reentrant activation "
            "checkpointing or a second backward through the same graph: use "
            "checkpoint(use_reentrant=False), or wrap extra backwards in no_sync()."
        )

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if bucket.pending:
                return
            if bucket.found_in_place:
                bucket.divide_found_in_place()
            bucket.times.launched = time.perf_counter()
            if self.comm_hook is None:
                bucket.handle = self.comm.all_reduce(bucket.buffer)
                self._in_flight.append(bucket.handle)
            else:
                is_last = self._next_bucket == len(self.buckets) - 1
                bucket.handle = self.comm_hook(self.comm_state, GradBucket(bucket, is_last))
            self._next_bucket += 1

    # ------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        backward_end = time.perf_counter()
        self._expect_sync = False
        for bucket in self.buckets[: self._next_bucket]:
            self._wait(bucket)
        if self._next_bucket < len(self.buckets):
            self._unfinished = self._unfinished_message()
            return
        globally_unused = set()
        if self.find_unused:
            # After every bucket is done, so no hook's collective can interleave with it.
            used = torch.tensor(self._used, dtype=torch.int32)
            dist.all_reduce(used, group=self.group)
            globally_unused = {i for i, n in enumerate(used.tolist()) if n == 0}
        self._write_back(globally_unused)
        self.steps += 1
        self.last_stats = self._stats(backward_end, time.perf_counter())

    def _wait(self, bucket: Bucket) -> None:
        handle = bucket.handle
        if not hasattr(handle, "done_at"):  # a comm hook's future
            result = handle.wait()
            result = result[0] if isinstance(result, list) else result
            if result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result.view_as(bucket.buffer))
            bucket.mark_done()
        else:
            handle.wait()
            bucket.times.done = handle.done_at

    def _write_back(self, globally_unused: set[int]) -> None:
        """Leave the averaged gradients in `.grad`; a parameter no rank used keeps its own."""
        if self.grad_as_view:
            # Every gradient that reached its slot already points there.
            for index in self._without_grad:
                if index not in globally_unused:
                    self.params[index].grad = self._view_of[index]
            return
        for index, param in enumerate(self.params):
            if index in globally_unused:
                continue
            view = self._view_of[index]
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)

    def _unfinished_message(self) -> str:
        missing = [self.names[i] for i, done in enumerate(self._marked) if not done]
        return (
            f"on rank {dist.get_rank()}, {len(missing)} parameter(s) received no gradient in "
            f"the previous backward, so their buckets were never reduced: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}. With find_unused_parameters=False every "
            "trainable parameter must contribute to the loss. Fix: pass "
            "find_unused_parameters=True to DistributedDataParallel, or freeze these "
            "parameters (requires_grad=False), or make their outputs part of the loss."
        )

    def _stats(self, backward_end: float, finalize_end: float) -> StepStats:
        start, forward_end = self._forward
        # A hook that compresses reports what it really sent; otherwise the full buffers went.
        take_sent = getattr(self.comm_state, "take_sent_bytes", None)
        sent = take_sent() if self.comm_hook is not None and take_sent else None
        marks = StepMarks(start, forward_end, backward_end, finalize_end)
        return step_stats(self.steps, self.world_size, self.buckets, marks, sent)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
