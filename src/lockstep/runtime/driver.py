"""`BackwardDriver`: one synchronised backward, the same for both engines.

An engine (the DDP `Reducer`, the sharded `GradSync`) registers its gradient
hooks and fills its buckets; everything else about a step is here, once:

| call | when | what the driver does |
|---|---|---|
| `arm` | end of a synchronised forward | a fresh `StepState` with this rank's fingerprint |
| `start` | first hook (or the engine's sink) | note the backward, queue `_finalize` |
| `filled` | a gradient reached its bucket | launch complete buckets in order; fingerprint last |
| `_finalize` | autograd is done | stall-aware waits, fingerprint check, write-back, stats |

The engine's side is a `GradientSink` (fill what no hook filled, take a finished
bucket's result, write `.grad`). After write-back the driver runs its
`end_of_step` actions (part of the step: mixed precision's fp32 restore, the
non-finite check's decision, whose rare slow path is a collective that live
recovery finishes again like the buckets), then its `observers` (read-only: the
tracer, the Monitor). CUDA streams belong here too, so both engines get them, and
so does the one slot live recovery fills (`recovery`, a `StepRecovery`:
`lockstep.live` installs it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from lockstep.errors import LockstepError, UnusedParametersError
from lockstep.runtime import waits
from lockstep.runtime.bucket import Bucket
from lockstep.runtime.bucket_collective import BucketCollective
from lockstep.runtime.data_passes import DataPasses
from lockstep.runtime.fingerprint import Fingerprint, StepFingerprint
from lockstep.runtime.step import StepState
from lockstep.runtime.step_stats import StepMarks, StepStats, step_stats
from lockstep.runtime.streams import at_backward_end

StepObserver = Callable[[StepStats], None]
Verdict = Callable[[], torch.Tensor | None]  # this rank's non-finite count, on the device
Digest = Callable[[], torch.Tensor | None]  # this rank's folded replica digest, on the device
_queue_at_backward_end = at_backward_end  # on the caller's streams: `runtime/streams.py`


class GradientSink(Protocol):
    """The engine's part of a step (each call gets the step that ends)."""

    def before_waits(self, step: StepState) -> None:
        """Autograd is done: fill and hand to `filled` what no hook did (or nothing)."""
        ...

    def collected(self, bucket: Bucket) -> None:
        """`bucket`'s collective has finished (called once, in launch order)."""
        ...

    def unfinished(self, step: StepState) -> str:
        """Why the step could not launch every bucket (raised at the next forward)."""
        ...

    def write_back(self, step: StepState) -> None:
        """Every bucket is reduced: leave the results where the optimizer reads them."""
        ...


class StepRecovery(Protocol):
    """The slot for "a rank was lost" inside a step (filled by `lockstep.live`)."""

    def launching(self, position: int, bucket: Bucket) -> None:
        """`bucket` is about to be launched at `position` (its local gradients, as they are)."""
        ...

    def lost(self, driver: BackwardDriver, step: StepState, error: BaseException) -> None:
        """A wait of `step` failed: finish the step with the replaced rank(s), or raise."""
        ...

    def layout_changed(self) -> None:
        """The buckets changed (the one rebuild)."""
        ...

    def armed(self) -> None:
        """A synchronised forward ended: its backward comes next."""
        ...

    def finished(self) -> None:
        """A synchronised step ended."""
        ...


class BackwardDriver:
    """Launch order, step state, fingerprint, waits, stats of one engine's backward.

    Args:
        sink: the engine's part (`GradientSink`).
        collective: what a complete bucket runs.
        process_group: the replicas' group (None: the default group).
        rank: this rank in the group, for messages.
        world_size: the group's size.
        check_data_passes: put the pass over the data in the fingerprint.
    """

    def __init__(
        self,
        sink: GradientSink,
        collective: BucketCollective,
        process_group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        check_data_passes: bool,
    ) -> None:
        self.sink, self.collective = sink, collective
        self.group, self.rank, self.world_size = process_group, rank, world_size
        self.fingerprint = StepFingerprint(process_group, rank, world_size)
        self.data_passes = DataPasses() if check_data_passes else None
        self.buckets: list[Bucket] = []
        self.layout_hash = 0
        self.observers: list[StepObserver] = []
        self.end_of_step: list[Callable[[], None]] = []
        self.verdict: Verdict = _no_verdict  # the non-finite check's (`runtime/finite.py`)
        # The replica check's (`runtime/replica_check.py`): a bucket's parameters digested
        # as it launches, the fold sent in the fingerprint.
        self.digest_bucket: Callable[[Bucket], None] | None = None
        self.digest: Digest = _no_verdict
        # A collective that counts what it sent, per level (the sharded ring); None: ring figure.
        self.wire_counter: Callable[[], dict[str, int]] | None = None
        self.step: StepState | None = None  # None outside a synchronised backward
        self.steps = 0
        self.last_stats: StepStats | None = None
        self.graph_open = False  # a finalized step's graph may be backwarded again
        self._micro_batches = 0  # forwards under no_sync() since the last synchronised one
        self._unfinished: str | None = None
        self.recovery: StepRecovery | None = None  # live recovery's slot (`lockstep.live`)

    def use_group(self, group: dist.ProcessGroup) -> None:
        """Run every later collective on `group` (the fingerprint's, the buckets')."""
        self.group = self.fingerprint.group = group
        collective = self.collective
        while hasattr(collective, "inner"):  # the checks wrapped around the transport
            collective = collective.inner
        transport = getattr(collective, "transport", None)
        if transport is not None:
            transport.process_group = group

    def use_buckets(self, buckets: Sequence[Bucket], layout_hash: int) -> None:
        """The buckets of the coming steps, in launch order, and their layout's hash."""
        self.buckets, self.layout_hash = list(buckets), layout_hash
        if self.recovery is not None:
            self.recovery.layout_changed()

    # ----------------------------------------------------------- forward side
    def check_previous_step(self) -> None:
        """Raise, before a forward, if the previous backward left buckets unreduced."""
        if self._unfinished is not None:
            message, self._unfinished = self._unfinished, None
            raise UnusedParametersError(message)

    def arm(self, num_params: int, unused: list[int], marks: tuple[float, float]) -> StepState:
        """State "armed": the next backward synchronises; `unused` are pre-marked at start.

        Args:
            num_params: how many gradients the engine marks per step.
            unused: those the forward did not reach.
            marks: perf_counter() at the start and the end of the forward.
        """
        passes = self.data_passes.note_step() if self.data_passes is not None else 0
        mine = Fingerprint(self.steps + 1, passes, self._micro_batches + 1, self.layout_hash)
        self._micro_batches = 0
        self.step = StepState.armed(num_params, unused, marks[0], marks[1], mine)
        self.graph_open = False
        if self.recovery is not None:
            self.recovery.armed()
        for bucket in self.buckets:
            bucket.reset()
        return self.step

    def forward_without_sync(self, accumulating: bool) -> None:
        """A forward that will not synchronise closes the last step; under no_sync it counts."""
        self.graph_open = False
        self._micro_batches += accumulating

    # ---------------------------------------------------------- backward side
    def start(self, step: StepState) -> None:
        """State "started": the backward is noted, `_finalize` waits for autograd's end."""
        step.started = True
        self.fingerprint.begin(step.fingerprint.step)
        _queue_at_backward_end(self._finalize)

    def filled(self, step: StepState, bucket: Bucket) -> None:
        """One more gradient is in `bucket`; launch what is complete, collect what finished.

        The hot path (once per gradient per step), so it stays flat.
        """
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.times.ready = time.perf_counter()
            self._launch_complete(step)
        in_flight = step.in_flight
        while in_flight and in_flight[0].handle.poll():
            self.sink.collected(in_flight.popleft())

    def _launch_complete(self, step: StepState) -> None:
        """Launch buckets strictly in index order: the same order on every rank."""
        last = len(self.buckets) - 1
        while step.next_bucket <= last:
            bucket = self.buckets[step.next_bucket]
            if bucket.pending:
                return
            bucket.times.launched = time.perf_counter()
            if self.digest_bucket is not None:
                self.digest_bucket(bucket)
            if self.recovery is not None:
                self.recovery.launching(step.next_bucket, bucket)
            bucket.handle = self.collective.launch(bucket, step.next_bucket == last)
            step.in_flight.append(bucket)
            step.next_bucket += 1
            if step.next_bucket > last:  # every bucket checked: the verdict is complete
                self.fingerprint_after_launch(step)

    def fingerprint_after_launch(self, step: StepState) -> None:
        """The last bucket is launched: send the fingerprint now, beside it, unless a bucket
        may still issue collectives (`issues_inline`): then `check_fingerprint` sends it.

        After the last bucket rather than at backward's start: the verdict it carries
        covers every bucket, so the non-finite check needs no collective of its own.
        """
        if self.collective.issues_inline():
            self.send_fingerprint(step)

    def send_fingerprint(self, step: StepState) -> None:
        """The step's fingerprint, with this rank's non-finite verdict and replica digest."""
        step.fingerprint_sent = True
        self.fingerprint.launch(step.fingerprint, self.verdict(), self.digest())

    def check_fingerprint(self, step: StepState) -> None:
        """The buckets are waited: send the fingerprint if it was kept back, then check it."""
        if not step.fingerprint_sent and step.next_bucket == len(self.buckets):
            self.send_fingerprint(step)
        self.fingerprint.check()

    def _finalize(self) -> None:
        """State "finalized": wait, write the results, record the step, drop its state."""
        backward_end = time.perf_counter()
        step, self.step = self.step, None
        assert step is not None
        self.sink.before_waits(step)
        try:
            self._wait_step(step)
        except RuntimeError as error:  # a lost rank: recovered live, or raised as before
            if self.recovery is None:
                raise
            self.recovery.lost(self, step, error)
        for bucket in self.buckets[: step.next_bucket]:
            bucket.times.done = bucket.handle.done_at if bucket.handle else 0.0
        if step.next_bucket < len(self.buckets):
            self._unfinished = self.sink.unfinished(step)
            return
        self.sink.write_back(step)
        self.steps += 1
        self.graph_open = True
        marks = StepMarks(step.forward_start, step.forward_end, backward_end, time.perf_counter())
        levels = self.wire_counter() if self.wire_counter is not None else None
        self.last_stats = step_stats(
            self.steps, self.world_size, self.buckets, marks, self.collective.sent_bytes(), levels
        )
        self._end_step(step)
        for observe in self.observers:
            observe(self.last_stats)
        if self.recovery is not None:
            self.recovery.finished()

    def _end_step(self, step: StepState) -> None:
        """The `end_of_step` actions. One may run a collective (the non-finite check's slow
        path, when a rank found one): a rank lost there is recovered like one lost in the
        waits, since the step is not over yet: the count goes back, the step's collectives
        run again with the replacement (which resumes at this step), and the actions run
        again."""
        try:
            for action in self.end_of_step:
                action()
        except RuntimeError as error:
            if self.recovery is None or isinstance(error, LockstepError):
                raise
            self.steps -= 1  # what the donor hands over: this step is not finished
            self.recovery.lost(self, step, error)
            self.sink.write_back(step)
            self.steps += 1
            for action in self.end_of_step:
                action()

    def _wait_step(self, step: StepState) -> None:
        """Wait for the step's buckets and check its fingerprint."""
        for bucket in step.in_flight:
            assert bucket.handle is not None
            waits.wait(bucket.handle, "gradient bucket", self.steps + 1, bucket.index, self.group)
            self.sink.collected(bucket)
        for bucket in self.buckets[: step.next_bucket]:  # collected early by a poll, too:
            if bucket.handle is not None:  # gloo marks a failed work completed; wait() raises
                bucket.handle.wait()
        step.reduced = True  # a loss met from here on: live recovery may take the outcome
        self.check_fingerprint(step)  # from a peer that finished the step (`live/steps.py`)
        step.checked = True


def _no_verdict() -> None:
    """No non-finite check (nonfinite="off"), or no replica check: their slots stay 0."""
    return None
