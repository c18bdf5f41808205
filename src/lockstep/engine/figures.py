"""What the engine measured and how it laid out the buckets, as the wrapper shows it.

`EngineFigures` is the wrapper's read-only side (its reducer does the work):
`stats` after every synchronised step, `add_step_observer` for the tracer and the
monitor, `payload_bytes` and `bucket_layout` for tests and the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep.runtime.step_stats import StepStats

if TYPE_CHECKING:
    from lockstep.engine.reducer import Reducer, StepObserver


class EngineFigures:
    """Mixed into `DistributedDataParallel`; reads `self.reducer`."""

    reducer: Reducer

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer(stats)` at the end of every synchronised step (after averaging).

        Observers run inside backward's final callback, so they must be cheap; the
        tracer and the monitor use this to see every step without extra clock reads.
        """
        self.reducer.observers.append(observer)

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last synchronised step, or None before the first."""
        return self.reducer.last_stats

    @property
    def payload_bytes(self) -> int:
        """Gradient bytes all-reduced per synchronised step (the sum of bucket sizes)."""
        return sum(bucket.nbytes for bucket in self.reducer.buckets)

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.reducer.names[i] for i in idx] for idx in self.reducer.layout]
