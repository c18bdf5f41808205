"""How the DDP engine laid out its buckets, as the wrapper shows it.

`EngineFigures` is the wrapper's read-only side: `stats` and `add_step_observer`
come from the driver (`runtime/step_figures.py`, the same for both engines);
`payload_bytes` and `bucket_layout` are DDP's own, for tests and the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep.runtime.step_figures import StepFigures

if TYPE_CHECKING:
    from lockstep.engine.reducer import Reducer
    from lockstep.runtime.driver import BackwardDriver


class EngineFigures(StepFigures):
    """Mixed into `DistributedDataParallel`; reads `self.reducer`."""

    reducer: Reducer

    @property
    def step_driver(self) -> BackwardDriver:
        return self.reducer.driver

    @property
    def finished_steps(self) -> int:
        """Synchronised steps so far; in a live replacement, its peers' count."""
        return self.reducer.driver.steps

    @property
    def payload_bytes(self) -> int:
        """Gradient bytes all-reduced per synchronised step (the sum of bucket sizes)."""
        return sum(bucket.nbytes for bucket in self.reducer.buckets)

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.reducer.names[i] for i in idx] for idx in self.reducer.layout.groups]
