"""Gradient synchronisation of the sharded engine: its part of the shared backward driver.

Each flat's `full` gets one post-accumulate-grad hook. In a synchronised
backward the hook hands the flat's gradient to its bucket (`ShardBucket`) and
tells the `BackwardDriver` (`lockstep.runtime.driver`), which launches buckets
strictly in launch order, waits with stall reports, checks the step
fingerprint, and records `StepStats` for observers, exactly as for DDP. Launch
order is the order gradients are expected: the flats' order for stages 1 and 2
(DDP's buckets), the reverse for stage 3 (the last unit's gradient comes first).
When autograd is done, flats that got no gradient are filled with zeros (every
rank launches the same collectives); a finished result is added to `shard.grad`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import BucketCollective
from lockstep.runtime.bucket_layout import layout_hash
from lockstep.runtime.driver import BackwardDriver
from lockstep.runtime.handles import CollectiveHandle
from lockstep.runtime.step import StepState
from lockstep.runtime.streams import at_backward_end
from lockstep.sharded.flat import FlatParam
from lockstep.sharded.precision import keep_local_grad, to_shard_dtype
from lockstep.sharded.reduce_scatter import ShardBucket, fill_bucket, shard_bucket
from lockstep.sharded.shard_grad import as_shard_grad
from lockstep.sharded.timeline import Span, Timeline

_run_at_end = at_backward_end  # on the caller's streams: `runtime/streams.py`


class GradSync:
    """The flats' hooks and buckets; `driver` runs the synchronised steps.

    Args:
        flats: the trainable flats, in launch order.
        collective: the bucket collective of the stage.
        process_group: the group the shards are spread over (None: the default group).
        rank: this rank in the group.
        world_size: the group's size.
        keep_full_grad: stage 1: `full.grad` holds the averaged gradient until the next
            forward; otherwise it is dropped as soon as it is in its bucket.
        after_grad: called with a flat once its gradient is taken (stage 3 frees it).
        at_backward_end: called at the end of every backward with whether it synchronised.
        check_data_passes: include the pass over the data in the step fingerprint.
    """

    def __init__(
        self,
        flats: list[FlatParam],
        collective: BucketCollective,
        process_group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        keep_full_grad: bool,
        after_grad: Callable[[FlatParam], None],
        at_backward_end: Callable[[bool], None],
        check_data_passes: bool,
    ) -> None:
        self.flats, self.rank = flats, rank
        self.keep_full_grad = keep_full_grad
        self.after_grad, self.at_backward_end = after_grad, at_backward_end
        self.driver = BackwardDriver(
            self, collective, process_group, rank, world_size, check_data_passes
        )
        self.buckets = [shard_bucket(pos, flat, collective) for pos, flat in enumerate(flats)]
        self.driver.use_buckets(self.buckets, layout_hash([[f.index] for f in flats]))
        self.timeline: Timeline | None = None
        self._backward_span: Span | None = None
        self._local_end_queued = False
        for pos, flat in enumerate(flats):
            flat.full.register_post_accumulate_grad_hook(self._hook_for(pos))

    def arm(self, forward_start: float, forward_end: float) -> None:
        """The coming backward synchronises (called at the end of a synchronised forward)."""
        self.driver.arm(len(self.flats), [], (forward_start, forward_end))

    def record_into(self, timeline: Timeline | None) -> None:
        """Record backward and each gradient collective into `timeline` (None: stop)."""
        self.timeline = timeline
        collective = self.driver.collective
        inner = collective.inner if isinstance(collective, _Recorded) else collective
        labels = [flat.unit for flat in self.flats]
        self.driver.collective = inner if timeline is None else _Recorded(inner, timeline, labels)

    def _hook_for(self, pos: int) -> Callable[[torch.Tensor], None]:
        flat = self.flats[pos]

        def hook(_: torch.Tensor) -> None:
            step = self.driver.step
            if step is None:
                keep_local_grad(flat)  # no_sync under a policy: kept in the reduce dtype
                self._local_backward()
            elif not step.marked[pos]:
                if not step.started:
                    self._begin_span()
                    self.driver.start(step)
                self._fill(step, pos)
            self.after_grad(flat)

        return hook

    def _fill(self, step: StepState, pos: int) -> None:
        step.marked[pos] = True
        flat = self.flats[pos]
        bucket = self.buckets[pos]
        fill_bucket(bucket, flat, self.rank)
        if not self.keep_full_grad:
            flat.full.grad = None  # the bucket keeps it until the collective is done
        self.driver.filled(step, bucket)

    def _local_backward(self) -> None:
        """A backward that accumulates locally: only the end-of-backward work, once."""
        if not self._local_end_queued:
            self._local_end_queued = True
            self._begin_span()
            _run_at_end(self._end_local_backward)

    def _end_local_backward(self) -> None:
        self._local_end_queued = False
        self._end_span()
        self.at_backward_end(False)
        if self.timeline is not None:
            self.timeline.poll()

    def _begin_span(self) -> None:
        if self.timeline is not None:
            self._backward_span = self.timeline.begin("compute", "backward")

    def _end_span(self) -> None:
        if self.timeline is not None and self._backward_span is not None:
            self.timeline.end(self._backward_span)
        self._backward_span = None

    # ------------------------------------------------- the driver's sink calls
    def before_waits(self, step: StepState) -> None:
        """Zeros for the flats no hook filled, so every rank launches every bucket."""
        self._end_span()
        for pos, flat in enumerate(self.flats):
            if not step.marked[pos]:
                flat.full.grad = torch.zeros_like(flat.full, memory_format=torch.contiguous_format)
                self._fill(step, pos)

    def collected(self, bucket: Bucket) -> None:
        """This rank's averaged shard into `shard.grad` (added: `.grad` accumulates)."""
        assert isinstance(bucket, ShardBucket) and bucket.shard_grad is not None
        shard = self.flats[bucket.index].shard
        grad = to_shard_dtype(bucket.shard_grad, self.flats[bucket.index])  # a policy casts
        if shard.grad is None:  # torch's clip_grad_norm_ sees the global norm
            shard.grad = as_shard_grad(grad, self.flats[bucket.index].process_group)
        else:
            shard.grad.add_(grad)
        bucket.release()

    def unfinished(self, step: StepState) -> str:  # every bucket is launched by before_waits
        raise AssertionError(f"rank {self.rank}: a sharded step left buckets unlaunched")

    def write_back(self, step: StepState) -> None:
        """The results are in `shard.grad` already; end the backward."""
        self.at_backward_end(True)
        if self.timeline is not None:
            self.timeline.poll()


class _Recorded:
    """A bucket collective whose launches are recorded as spans of a `Timeline`."""

    def __init__(self, inner: BucketCollective, timeline: Timeline, labels: list[str]) -> None:
        self.inner, self.timeline, self.labels = inner, timeline, labels

    def averaging(self, dtype: torch.dtype):
        return self.inner.averaging(dtype)

    def launch(self, bucket: Bucket, is_last: bool) -> CollectiveHandle:
        start = time.perf_counter()
        handle = self.inner.launch(bucket, is_last)
        self.timeline.collective("reduce", self.labels[bucket.index], handle, start)
        return handle

    def sent_bytes(self) -> int | None:
        return self.inner.sent_bytes()

    def issues_inline(self) -> bool:
        return self.inner.issues_inline()
