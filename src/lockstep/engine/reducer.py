"""`Reducer`: the part of backward where data parallelism happens.

One post-accumulate-grad hook per parameter marks its gradient ready: the
gradient goes into its slot of a bucket (copied, or found there already with
gradient_as_bucket_view), scaled as the bucket collective decided. When a
bucket's last gradient arrives the bucket is complete, and buckets are launched
strictly in index order, so every rank issues the same collectives in the same
order. The first hook of a backward queues `_finalize` on the autograd engine;
it runs when autograd has no work left, waits for the collectives and leaves
averaged gradients in `.grad`. A step's state lives in one `StepState`
(`lockstep.engine.step`, which also tabulates the states). After the first
synchronised step the buckets are rebuilt once, in the order gradients really
became ready (rank 0's order, broadcast to all).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist

from lockstep.engine import stall
from lockstep.engine.bucket import Bucket
from lockstep.engine.bucketing import assign_buckets, param_specs
from lockstep.engine.collective import Averaging, BucketCollective
from lockstep.engine.create_graph import mark_keeping_graph, warn_once
from lockstep.engine.data_passes import DataPasses
from lockstep.engine.fingerprint import Fingerprint, StepFingerprint, layout_hash
from lockstep.engine.stats import StepMarks, StepStats, step_stats
from lockstep.engine.step import StepState
from lockstep.engine.step_errors import ready_twice, second_backward, unfinished
from lockstep.errors import UnusedParametersError

StepObserver = Callable[[StepStats], None]
GradHook = Callable[[torch.Tensor], None]


class Reducer:
    """Buckets, hooks and the per-step state machine of gradient synchronisation.

    Args:
        named_params: the trainable parameters, in registration order.
        collective: what a complete bucket runs (`lockstep.engine.collective`).
        process_group: the replicas' group (rebuild broadcast, unused-parameter vote).
        rank: this process's rank in `process_group`, for messages.
        world_size: the number of replicas.
        first_cap_bytes: cap of the first bucket.
        cap_bytes: cap of the others.
        find_unused: tolerate parameters without a gradient (one extra vote per step).
        gradient_as_bucket_view: leave `.grad` pointing into the buckets.
        check_data_passes: include the pass over the data in the step fingerprint.
        cap_list: per-bucket caps (torch's bucket_cap_mb_list), overriding the two caps.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        collective: BucketCollective,
        *,
        process_group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        first_cap_bytes: int,
        cap_bytes: int,
        find_unused: bool,
        gradient_as_bucket_view: bool,
        check_data_passes: bool = True,
        cap_list: list[int] | None = None,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.specs = param_specs(named_params)
        self.collective = collective
        self.group = process_group
        self.rank, self.world_size = rank, world_size
        self.first_cap_bytes, self.cap_bytes = first_cap_bytes, cap_bytes
        self.cap_list = cap_list
        self.find_unused = find_unused
        self.grad_as_view = gradient_as_bucket_view
        self.observers: list[StepObserver] = []
        self.end_of_step: list[Callable[[], None]] = []  # after observers: engine/finite.py
        self.steps = 0
        self.last_stats: StepStats | None = None
        self.step: StepState | None = None  # None outside a synchronised backward
        self.fingerprint = StepFingerprint(process_group, rank, world_size)
        self.data_passes = DataPasses() if check_data_passes else None
        self._synced_graph_open = False  # a finalized step's graph may be backwarded again
        self._micro_batches = 0  # forwards under no_sync() since the last synchronised one
        self._rebuilt = False
        self._ready_order: list[int] = []
        self._unfinished: str | None = None
        # Parameters whose hook fired since the last synchronised step (torch's local
        # used map: a micro-batch under no_sync() counts); only find_unused reads it.
        self._used_since_sync = [False] * len(self.params) if find_unused else None
        self._mark = self._mark_ready  # or its no-grad form in a create_graph backward
        self.static = False  # static graph (`engine/static_graph.py`) installs its hooks
        self.static_unused: set[int] | None = None  # static graph: known after step 1
        self._build(self._layout(None))
        self._handles: list = []
        self.replace_hooks(self._hook_for)

    # ----------------------------------------------------------------- layout
    def _layout(self, order: list[int] | None) -> list[list[int]]:
        caps = {"first_cap_bytes": self.first_cap_bytes, "cap_bytes": self.cap_bytes}
        return assign_buckets(self.specs, order, **caps, cap_list=self.cap_list)

    def _build(self, layout: list[list[int]]) -> None:
        """Allocate one bucket per group of `layout`; map each parameter to its slot."""
        self.layout = layout
        self.buckets = [
            Bucket.build(
                b,
                [self.params[i] for i in idx],
                idx,
                self.collective.averaging(self.params[idx[0]].dtype),
            )
            for b, idx in enumerate(layout)
        ]
        slot = {i: (b, b.views[pos]) for b in self.buckets for pos, i in enumerate(b.param_indices)}
        self._layout_hash = layout_hash(layout)
        self._bucket_of = [slot[i][0] for i in range(len(self.params))]
        self._view_of = [slot[i][1] for i in range(len(self.params))]
        if self.grad_as_view:
            self._move_grads_into_views()

    def _move_grads_into_views(self) -> None:
        """Existing gradients move into their new slots, and `.grad` points there."""
        for param, view in zip(self.params, self._view_of, strict=True):
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = view

    def replace_hooks(self, hook_for: Callable[[int], GradHook]) -> None:
        """Register `hook_for(i)` on parameter i, removing the hooks registered before."""
        for handle in self._handles:
            handle.remove()
        self._handles = [
            param.register_post_accumulate_grad_hook(hook_for(i))
            for i, param in enumerate(self.params)
        ]

    def average_over(self, count: int) -> None:
        """Divide this step's gradients by `count` ranks (Join: the ranks not yet joined)."""
        for bucket in self.buckets:
            averaging = self.collective.averaging(bucket.buffer.dtype)
            if averaging is not None and averaging.divisor != count:
                averaging = Averaging.for_dtype(
                    count, bucket.buffer.dtype, averaging.copies_divided
                )
            bucket.averaging = averaging

    def set_collective(self, collective: BucketCollective) -> None:
        """Use `collective` for every bucket from now on (a communication hook)."""
        self.collective = collective
        for bucket in self.buckets:
            bucket.averaging = collective.averaging(bucket.buffer.dtype)

    def rebuild_if_needed(self) -> None:
        """Once, before the second synchronised forward: re-bucket in observed ready order."""
        if self._rebuilt or len(self._ready_order) != len(self.params):
            return
        order = torch.tensor(self._ready_order, dtype=torch.int64)
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group else 0
            dist.broadcast(order, src, group=self.group)
        self._build(self._layout(order.tolist()))
        self._rebuilt = True

    # ------------------------------------------------------------ each step
    def check_previous_step(self) -> None:
        """Raise, before a forward, if the previous backward left buckets unreduced."""
        if self._unfinished is not None:
            message, self._unfinished = self._unfinished, None
            raise UnusedParametersError(message)

    def arm(self, unused: list[int], forward_start: float, forward_end: float) -> None:
        """State "armed": the next backward synchronises; `unused` are pre-marked ready."""
        passes = self.data_passes.note_step() if self.data_passes is not None else 0
        mine = Fingerprint(self.steps + 1, passes, self._micro_batches + 1, self._layout_hash)
        self._micro_batches = 0
        self.step = StepState.armed(len(self.params), unused, forward_start, forward_end, mine)
        if self._used_since_sync is not None:
            self.step.used, self._used_since_sync = (
                self._used_since_sync,
                [False] * len(self.params),
            )
        self._synced_graph_open = False
        for bucket in self.buckets:
            bucket.reset()

    def forward_without_sync(self, accumulating: bool) -> None:
        """A forward that will not synchronise closes the last step; under no_sync it counts."""
        self._synced_graph_open = False
        self._micro_batches += accumulating

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            step = self.step
            if step is not None:
                if not step.started:
                    self._start(step)
                step.used[index] = True
                self._mark(step, index, param)
            else:
                self.outside_step(index)

        return hook

    def outside_step(self, index: int) -> None:
        """A hook outside a synchronised backward: note local use, refuse a second backward."""
        if self._synced_graph_open:
            raise second_backward(self.names[index], self.rank)
        if self._used_since_sync is not None:
            self._used_since_sync[index] = True

    def _start(self, step: StepState) -> None:
        """State "started": queue finalize on autograd, pre-mark unused parameters."""
        step.started = True
        self.fingerprint.launch(step.fingerprint)  # first of the step's collectives
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        self._mark = self._mark_ready
        if torch.is_grad_enabled():  # backward(create_graph=True): `engine/create_graph.py`
            self._mark = partial(mark_keeping_graph, self)
            warn_once()
        for unused in step.unused:
            self._mark(step, unused, self.params[unused])

    def _mark_ready(self, step: StepState, index: int, param: torch.Tensor) -> None:
        """State "filling": the gradient into its slot; launch the bucket if it completed.

        The hot path (once per parameter per step), so it stays flat.
        """
        if step.marked[index]:
            raise ready_twice(self.names[index], self.rank)
        step.marked[index] = True
        if not self._rebuilt:
            self._ready_order.append(index)
        view = self._view_of[index]
        bucket = self._bucket_of[index]
        grad = param.grad
        if grad is None:
            view.zero_()
            step.without_grad.append(index)
        elif grad.data_ptr() == view.data_ptr():
            bucket.found(view)
        else:
            bucket.copy_in(view, grad)
            if self.grad_as_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.times.ready = time.perf_counter()
            self._launch_complete_buckets(step)
        in_flight = step.in_flight
        while in_flight and in_flight[0].poll():
            in_flight.popleft()

    def _launch_complete_buckets(self, step: StepState) -> None:
        last = len(self.buckets) - 1
        while step.next_bucket <= last:
            bucket = self.buckets[step.next_bucket]
            if bucket.pending:
                return
            bucket.times.launched = time.perf_counter()
            bucket.handle = self.collective.launch(bucket, step.next_bucket == last)
            step.in_flight.append(bucket.handle)
            step.next_bucket += 1

    # ------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        """State "finalized": wait, write `.grad`, record the step, drop its state."""
        backward_end = time.perf_counter()
        step, self.step = self.step, None
        assert step is not None
        for bucket in self.buckets[: step.next_bucket]:
            assert bucket.handle is not None
            stall.wait(bucket.handle, "gradient bucket", self.steps + 1, bucket.index, self.group)
            bucket.times.done = bucket.handle.done_at
        self.fingerprint.check()
        if step.next_bucket < len(self.buckets):
            missing = [self.names[i] for i, done in enumerate(step.marked) if not done]
            self._unfinished = unfinished(missing, self.rank)
            return
        self._write_back(step, self._globally_unused(step.used))
        self.steps += 1
        self._synced_graph_open = True
        marks = StepMarks(step.forward_start, step.forward_end, backward_end, time.perf_counter())
        self.last_stats = step_stats(
            self.steps, self.world_size, self.buckets, marks, self.collective.sent_bytes()
        )
        for observe in self.observers:
            observe(self.last_stats)
        for action in self.end_of_step:  # may raise on every rank (engine/finite.py)
            action()

    def votes_unused(self) -> bool:
        """Whether a step ends with the vote on used parameters (Join shadows it too)."""
        return (self.find_unused or self.static) and self.static_unused is None

    def _globally_unused(self, used: list[bool]) -> set[int]:
        """Parameters no rank used: a vote of used flags, or what static graph knows."""
        if not self.votes_unused():
            return self.static_unused or set()
        # After every bucket is done, so no hook's collective can interleave with it.
        flags = torch.tensor(used, dtype=torch.int32)
        dist.all_reduce(flags, group=self.group)
        unused = {i for i, n in enumerate(flags.tolist()) if n == 0}
        if self.static:
            self.static_unused = unused
        return unused

    def _write_back(self, step: StepState, globally_unused: set[int]) -> None:
        """Leave the averaged gradients in `.grad`; a parameter no rank used keeps its own."""
        for index in step.copy_back:  # gradients with a graph (create_graph=True)
            self.params[index].grad.copy_(self._view_of[index])
        if self.grad_as_view:
            # Every gradient that reached its slot already points there.
            for index in step.without_grad:
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
