"""`StepMetrics`: one training step in figures, and the summary of a logging interval.

The engine stamps forward, backward and every bucket (`StepStats`); the monitor
adds what only the training loop knows: when the step ended, how long the
optimizer took, how many samples went through. `measure()` joins the two after
`optimizer.step()`; `summarize()` folds the steps of one log interval into the
figures of the compact log line. Nothing here talks to other ranks.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any

from lockstep.runtime.step_stats import StepStats


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step cost on this rank (times in seconds).

    Attributes:
        step: number of the step (counted by the monitor, 1-based, resumable).
        samples: samples processed in the step by all ranks (batch_size x world_size).
        step_seconds: wall time of the whole iteration, from the end of the previous
            step (or this step's forward, for the first one) to the end of this one.
        data_seconds: from the end of the previous step to this step's forward: data
            loading, and the forwards and backwards of any `no_sync()` micro-steps.
        forward_seconds: the wrapped module's forward.
        backward_seconds: autograd's work, all-reduces running beside it.
        exposed_seconds: the time backward waited for communication after autograd was done.
        optimizer_seconds: `optimizer.step()` (0 when the monitor was not given the optimizer).
        comm_seconds: sum over buckets of all-reduce time, launch to done.
        comm_span_seconds: first launch to last completion.
        overlap: share of the all-reduce span hidden behind backward, in [0, 1].
        payload_bytes: gradient bytes handed to the all-reduce.
        wire_bytes: bytes this rank sent (ring figure, or what a comm hook reported).
        bucket_seconds: each bucket's all-reduce time, launch to done, in launch order.
        synced: False when no synchronised backward happened since the previous step.
        loss: the step's loss averaged over ranks, once the monitor has read it.
    """

    step: int
    samples: int
    step_seconds: float
    data_seconds: float
    forward_seconds: float
    backward_seconds: float
    exposed_seconds: float
    optimizer_seconds: float
    comm_seconds: float
    comm_span_seconds: float
    overlap: float
    payload_bytes: int
    wire_bytes: int
    bucket_seconds: tuple[float, ...]
    synced: bool = True
    loss: float | None = None

    @property
    def samples_per_second(self) -> float:
        """Throughput of the whole job in this step (all ranks)."""
        return self.samples / self.step_seconds if self.step_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A flat, JSON-ready record (bucket times as a list)."""
        record = {name: getattr(self, name) for name in _FIELDS}
        record["bucket_seconds"] = list(self.bucket_seconds)
        record["samples_per_second"] = self.samples_per_second
        return record


_FIELDS = tuple(f.name for f in fields(StepMetrics))


def measure(
    stats: StepStats | None,
    *,
    step: int,
    samples: int,
    step_seconds: float,
    data_seconds: float,
    optimizer_seconds: float,
) -> StepMetrics:
    """Join the engine's figures of a step with the loop's own.

    Args:
        stats: the engine's `ddp.stats` for this step, or None when this step had no
            synchronised backward (then the engine's figures are zero).
        step: the step's number.
        samples: samples processed in the step by all ranks.
        step_seconds: wall time of the iteration.
        data_seconds: time before the step's forward.
        optimizer_seconds: time in `optimizer.step()`.

    Returns:
        The frozen `StepMetrics` (loss not yet filled in).
    """
    if stats is None:
        return StepMetrics(
            step,
            samples,
            step_seconds,
            data_seconds,
            0.0,
            0.0,
            0.0,
            optimizer_seconds,
            0.0,
            0.0,
            1.0,
            0,
            0,
            (),
            synced=False,
        )
    span = stats.comm_span_seconds
    return StepMetrics(
        step=step,
        samples=samples,
        step_seconds=step_seconds,
        data_seconds=data_seconds,
        forward_seconds=stats.forward_seconds,
        backward_seconds=stats.backward_seconds,
        exposed_seconds=stats.exposed_seconds,
        optimizer_seconds=optimizer_seconds,
        comm_seconds=stats.comm_seconds,
        comm_span_seconds=span,
        overlap=stats.overlap,
        payload_bytes=stats.payload_bytes,
        wire_bytes=stats.wire_bytes,
        bucket_seconds=tuple(b.done - b.launched for b in stats.buckets),
    )


@dataclass(frozen=True)
class IntervalSummary:
    """The steps of one log interval, folded into the figures of one log line.

    Attributes:
        step: the last step of the interval.
        steps: how many steps the interval holds.
        loss: mean loss over the interval (None when no loss was given).
        ms_per_step: median iteration time, in milliseconds.
        samples_per_second: samples of the interval over its wall time.
        overlap: 1 - exposed / all-reduce span, both summed over the interval.
        wire_bytes_per_step: mean bytes this rank sent per step.
    """

    step: int
    steps: int
    loss: float | None
    ms_per_step: float
    samples_per_second: float
    overlap: float
    wire_bytes_per_step: float


def summarize(steps: list[StepMetrics]) -> IntervalSummary:
    """Fold the metrics of one interval (at least one step) into a summary.

    Raises:
        ValueError: `steps` is empty.
    """
    if not steps:
        raise ValueError("summarize() expected the metrics of at least one step; found none")
    wall = sum(m.step_seconds for m in steps)
    span = sum(m.comm_span_seconds for m in steps)
    exposed = sum(m.exposed_seconds for m in steps)
    losses = [m.loss for m in steps if m.loss is not None]
    return IntervalSummary(
        step=steps[-1].step,
        steps=len(steps),
        loss=statistics.fmean(losses) if losses else None,
        ms_per_step=1e3 * statistics.median(m.step_seconds for m in steps),
        samples_per_second=sum(m.samples for m in steps) / wall if wall > 0 else 0.0,
        overlap=max(0.0, min(1.0, 1.0 - exposed / span)) if span > 0 else 1.0,
        wire_bytes_per_step=statistics.fmean(m.wire_bytes for m in steps),
    )
