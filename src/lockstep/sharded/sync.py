"""Gradient synchronisation of the sharded engine, driven by backward.

Each flat's `full` gets one post-accumulate-grad hook. In a synchronised
backward the first hook queues `_end_backward` on the autograd engine; each
hook launches its flat's collective at once (every rank runs the same graph, so
the same collectives in the same order), and finished ones are collected while
backward goes on. `_end_backward` launches zeros for flats that got no gradient
(in index order on every rank), waits for the rest and leaves this rank's
averaged shard in `shard.grad` (added to what is there, as `.grad` accumulates).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from lockstep.engine.collective import BucketCollective
from lockstep.engine.handles import CollectiveHandle
from lockstep.sharded.collective import ShardBucket, bucket_of
from lockstep.sharded.flat import FlatParam
from lockstep.sharded.shard_grad import as_shard_grad
from lockstep.sharded.timeline import Span, Timeline

_run_at_end = torch.autograd.Variable._execution_engine.queue_callback


class GradSync:
    """Launches and collects the flats' gradient collectives during backward.

    Args:
        flats: every flat of the model, in index order.
        collective: the bucket collective of the stage.
        rank: this rank in the group.
        keep_full_grad: stage 1: `full.grad` holds the averaged gradient until the next
            forward; otherwise it is dropped as soon as its collective has finished.
        after_grad: called with a flat once its gradient is taken (stage 3 frees it).
        at_backward_end: called at the end of every backward, synchronised or not.
    """

    def __init__(
        self,
        flats: list[FlatParam],
        collective: BucketCollective,
        rank: int,
        keep_full_grad: bool,
        after_grad: Callable[[FlatParam], None],
        at_backward_end: Callable[[], None],
    ) -> None:
        self.flats, self.collective, self.rank = flats, collective, rank
        self.keep_full_grad = keep_full_grad
        self.after_grad, self.at_backward_end = after_grad, at_backward_end
        self.syncing = False
        self.queued = False
        self.launched: set[int] = set()
        self.in_flight: deque[tuple[CollectiveHandle, FlatParam, ShardBucket]] = deque()
        self.timeline: Timeline | None = None
        self._backward_span: Span | None = None
        for flat in flats:
            flat.full.register_post_accumulate_grad_hook(self._hook_for(flat))

    def arm(self, syncing: bool) -> None:
        """Called at the end of forward: the coming backward synchronises or accumulates."""
        self.syncing = syncing
        self.launched = set()

    def _hook_for(self, flat: FlatParam) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if not self.queued:
                self.queued = True
                _run_at_end(self._end_backward)
                if self.timeline is not None:
                    self._backward_span = self.timeline.begin("compute", "backward")
            if self.syncing and flat.index not in self.launched:
                self._launch(flat)
                self._collect(block=False)
            self.after_grad(flat)

        return hook

    def _launch(self, flat: FlatParam) -> None:
        self.launched.add(flat.index)
        bucket = bucket_of(flat, self.collective, self.rank)
        start = time.perf_counter()
        handle = self.collective.launch(bucket, is_last=len(self.launched) == len(self.flats))
        if self.timeline is not None:
            self.timeline.collective("reduce", flat.unit, handle, start)
        self.in_flight.append((handle, flat, bucket))
        if not self.keep_full_grad:
            flat.full.grad = None  # the bucket keeps it until the collective is done

    def _collect(self, block: bool) -> None:
        """Move finished results into `shard.grad`, oldest first."""
        while self.in_flight and (block or self.in_flight[0][0].poll()):
            handle, flat, bucket = self.in_flight.popleft()
            handle.wait()
            result = bucket.shard_grad
            assert result is not None
            if flat.shard.grad is None:  # torch's clip_grad_norm_ sees the global norm
                flat.shard.grad = as_shard_grad(result, flat.process_group)
            else:
                flat.shard.grad.add_(result)

    def _end_backward(self) -> None:
        self.queued = False
        if self.timeline is not None and self._backward_span is not None:
            self.timeline.end(self._backward_span)
        if self.syncing:
            for flat in self.flats:
                if flat.index not in self.launched:
                    flat.full.grad = torch.zeros_like(
                        flat.full, memory_format=torch.contiguous_format
                    )
                    self._launch(flat)
            self._collect(block=True)
            self.syncing = False
        self.at_backward_end()
        if self.timeline is not None:
            self.timeline.poll()
