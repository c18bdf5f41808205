"""The DDP engine's part of a backward: per-parameter hooks that fill the buckets.

Every trainable parameter gets a post-accumulate-grad hook. In a synchronised
backward the hook puts the gradient into its slot of a bucket (`BucketLayout`)
and tells the `BackwardDriver` (`lockstep.runtime.driver`), which launches
complete buckets in index order, waits, checks the fingerprint and records the
step for both engines alike. What stays here is DDP's own: gradients copied or
found in place, unused parameters (a graph walk or a vote), the one rebuild of
the buckets in the order gradients really became ready (rank 0's order,
broadcast to all), and `.grad` written back. Torch's modes (static graph,
create_graph, Join) use the public calls `start`, `mark` and `replace_hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from lockstep.context import DistContext
from lockstep.engine.create_graph import mark_keeping_graph, warn_once
from lockstep.runtime import waits
from lockstep.runtime.averaging import Averaging
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import BucketCollective
from lockstep.runtime.bucket_layout import BucketLayout
from lockstep.runtime.bucketing import assign_buckets, param_specs
from lockstep.runtime.control_device import control_device
from lockstep.runtime.driver import BackwardDriver
from lockstep.runtime.recovery import Point, run
from lockstep.runtime.step import StepState
from lockstep.runtime.step_errors import ready_twice, second_backward, unfinished

GradHook = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class BucketCaps:
    """Bucket caps in bytes: the first bucket's, the others', or one per bucket (a list)."""

    first: int
    rest: int
    per_bucket: list[int] | None


class Reducer:
    """Buckets, hooks and `.grad` of the DDP engine; its `driver` runs the step.

    Args:
        named_params: the trainable parameters, in registration order.
        collective: what a complete bucket runs (`lockstep.runtime.bucket_collective`).
        process_group: the replicas' group (rebuild broadcast, unused-parameter vote).
        ctx: this process's place in `process_group` (rank, world size, global ranks).
        caps: the bucket caps.
        find_unused: tolerate parameters without a gradient (one extra vote per step).
        gradient_as_bucket_view: leave `.grad` pointing into the buckets.
        check_data_passes: include the pass over the data in the step fingerprint.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        collective: BucketCollective,
        *,
        process_group: dist.ProcessGroup | None,
        ctx: DistContext,
        caps: BucketCaps,
        find_unused: bool,
        gradient_as_bucket_view: bool,
        check_data_passes: bool,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.specs = param_specs(named_params)
        self.group, self.rank, self.world_size = process_group, ctx.rank, ctx.world_size
        self.root = ctx.global_rank(0)  # the source of the rebuilt order
        self.caps = caps
        self.find_unused = find_unused
        self.grad_as_view = gradient_as_bucket_view
        self.driver = BackwardDriver(
            self, collective, process_group, ctx.rank, ctx.world_size, check_data_passes
        )
        self._rebuilt = False
        self._ready_order: list[int] = []
        # Parameters whose hook fired since the last synchronised step (torch's local
        # used map: a micro-batch under no_sync() counts); only find_unused reads it.
        self._used_since_sync = [False] * len(self.params) if find_unused else None
        self.mark = self._mark_ready  # or its no-grad form in a create_graph backward
        self.static = False  # static graph (`engine/static_graph.py`) installs its hooks
        self.static_unused: set[int] | None = None  # static graph: known after step 1
        # The wrapper's require_backward_grad_sync (set by the wrapper): a backward under
        # no_sync() accumulates locally, as asked, even after a synchronised one.
        self.sync_requested: Callable[[], bool] = lambda: True
        self._use_layout(self.groups_for(None))
        self._handles: list = []
        self.replace_hooks(self._hook_for)

    # ----------------------------------------------------------------- layout
    def groups_for(self, order: list[int] | None) -> list[list[int]]:
        """The buckets (parameter indices) made in ready `order` (None: registration's)."""
        caps = self.caps
        return assign_buckets(
            self.specs,
            order,
            first_cap_bytes=caps.first,
            cap_bytes=caps.rest,
            cap_list=caps.per_bucket,
        )

    def _use_layout(self, groups: list[list[int]]) -> None:
        """Allocate the buckets of `groups`; the driver launches them from now on."""
        self.layout = BucketLayout(self.params, groups, self.driver.collective.averaging)
        self.driver.use_buckets(self.layout.buckets, self.layout.hash)
        if self.grad_as_view:
            self.layout.move_grads_into_views(self.params)

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    def replace_hooks(self, hook_for: Callable[[int], GradHook]) -> None:
        """Register `hook_for(i)` on parameter i, removing the hooks registered before."""
        for handle in self._handles:
            handle.remove()
        self._handles = [
            param.register_post_accumulate_grad_hook(hook_for(i))
            for i, param in enumerate(self.params)
        ]

    def remove_hooks(self) -> None:
        """Take the hooks off the parameters (the wrapper is gone, as torch's reducer does)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def average_over(self, count: int) -> None:
        """Divide this step's gradients by `count` ranks (Join: the ranks not yet joined)."""
        for bucket in self.buckets:
            averaging = self.driver.collective.averaging(bucket.buffer.dtype)
            if averaging is not None and averaging.divisor != count:
                averaging = Averaging.for_dtype(
                    count, bucket.buffer.dtype, averaging.copies_divided
                )
            bucket.averaging = averaging

    def set_collective(self, collective: BucketCollective) -> None:
        """Use `collective` for every bucket from now on (a communication hook)."""
        self.driver.collective = collective
        for bucket in self.buckets:
            bucket.averaging = collective.averaging(bucket.buffer.dtype)

    def rebuild_if_needed(self) -> None:
        """Once, before the second synchronised forward: re-bucket in observed ready order.

        Rank 0's order goes to every rank by a broadcast, a recovery point at the step's
        start (`runtime/recovery.py`): after a loss met there, the order comes from rank
        0's post instead (`Outcome.value`).
        """
        if not self.rebuild_due():
            return
        order = self._ready_order
        if self.world_size > 1:
            sent = torch.tensor(order, dtype=torch.int64, device=control_device(self.group))
            outcome = run(
                Point.REBUILD,
                self.driver.steps + 1,
                lambda: dist.broadcast(sent, self.root, group=self.group, async_op=True),
                value=order,
                group=self.group,
            )
            order = sent.tolist() if outcome.ran else outcome.value
        self._use_layout(self.groups_for(order))
        self._rebuilt = True

    def rebuild_due(self) -> bool:
        """The one rebuild has not happened, and every parameter's ready time is known."""
        return not self._rebuilt and len(self._ready_order) == len(self.params)

    @property
    def rebuilt(self) -> bool:
        return self._rebuilt

    @property
    def ready_order(self) -> list[int]:
        """The order this rank's gradients became ready in its first steps (rebuild's input)."""
        return list(self._ready_order)

    def use_group(self, group: dist.ProcessGroup) -> None:
        """Run every later collective on `group` (live recovery re-formed the default one)."""
        self.group = group
        self.driver.use_group(group)

    def adopt_layout(self, groups: list[list[int]], rebuilt: bool, ready: list[int]) -> None:
        """A live replacement takes a survivor's layout, rebuilt or not (then the order
        observed so far: a replacement that starts before the rebuild runs it with its peers)."""
        if [list(g) for g in self.layout.groups] != groups:
            self._use_layout(groups)
        self._rebuilt = rebuilt
        self._ready_order = list(ready)

    # ------------------------------------------------------------ each step
    def arm(self, unused: list[int], forward_start: float, forward_end: float) -> None:
        """The next backward synchronises; `unused` are pre-marked ready when it starts."""
        step = self.driver.arm(len(self.params), unused, (forward_start, forward_end))
        if self._used_since_sync is not None:
            step.used, self._used_since_sync = self._used_since_sync, [False] * len(self.params)

    def _hook_for(self, index: int) -> GradHook:
        def hook(param: torch.Tensor) -> None:
            step = self.driver.step
            if step is not None:
                if not step.started:
                    self.start(step)
                step.used[index] = True
                self.mark(step, index, param)
            else:
                self.outside_step(index)

        return hook

    def outside_step(self, index: int) -> None:
        """A hook outside a synchronised backward: note local use, refuse a second backward.

        Under no_sync() it is a local accumulation, not a second backward: a framework's
        forward may hold several backwards (Lightning's `toggle_model(sync_grad=False)`).
        """
        if self.driver.graph_open and self.sync_requested():
            raise second_backward(self.names[index], self.rank)
        if self._used_since_sync is not None:
            self._used_since_sync[index] = True

    def start(self, step: StepState) -> None:
        """Begin the armed step: the driver's start, then pre-mark the unused parameters."""
        self.driver.start(step)
        self.mark = self._mark_ready
        if torch.is_grad_enabled():  # backward(create_graph=True): `engine/create_graph.py`
            self.mark = partial(mark_keeping_graph, self._mark_ready)
            warn_once()
        for unused in step.unused:
            self.mark(step, unused, self.params[unused])

    def _mark_ready(self, step: StepState, index: int, param: torch.Tensor) -> None:
        """The gradient into its slot; the driver launches the bucket once complete.

        The hot path (once per parameter per step), so it stays flat.
        """
        if step.marked[index]:
            raise ready_twice(self.names[index], self.rank)
        step.marked[index] = True
        if not self._rebuilt:
            self._ready_order.append(index)
        view = self.layout.view_of[index]
        bucket = self.layout.bucket_of[index]
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
        self.driver.filled(step, bucket)

    # ------------------------------------------------- the driver's sink calls
    def before_waits(self, step: StepState) -> None:
        """Nothing to add: every bucket a hook completed is launched already."""

    def collected(self, bucket: Bucket) -> None:
        """The result is in the bucket's buffer already; `.grad` is written at the end."""

    def unfinished(self, step: StepState) -> str:
        missing = [self.names[i] for i, done in enumerate(step.marked) if not done]
        return unfinished(missing, self.rank)

    def write_back(self, step: StepState) -> None:
        """Leave the averaged gradients in `.grad`; a parameter no rank used keeps its own."""
        globally_unused = self._globally_unused(step.used)
        view_of = self.layout.view_of
        for index in step.copy_back:  # gradients with a graph (create_graph=True)
            self.params[index].grad.copy_(view_of[index])
        if self.grad_as_view:
            # Every gradient that reached its slot already points there.
            for index in step.without_grad:
                if index not in globally_unused:
                    self.params[index].grad = view_of[index]
            return
        for index, param in enumerate(self.params):
            if index in globally_unused:
                continue
            if param.grad is None:
                param.grad = view_of[index].clone()
            else:
                param.grad.copy_(view_of[index])

    def votes_unused(self) -> bool:
        """Whether a step ends with the vote on used parameters (Join shadows it too)."""
        return (self.find_unused or self.static) and self.static_unused is None

    def _globally_unused(self, used: list[bool]) -> set[int]:
        """Parameters no rank used: a vote of used flags, or what static graph knows."""
        if not self.votes_unused():
            return self.static_unused or set()
        # After every bucket is done, so no hook's collective can interleave with it.
        flags = torch.tensor(used, dtype=torch.int32, device=control_device(self.group))
        work = dist.all_reduce(flags, group=self.group, async_op=True)
        waits.collective(work, "unused-parameter vote", self.group)
        unused = {i for i, n in enumerate(flags.tolist()) if n == 0}
        if self.static:
            self.static_unused = unused
        return unused
