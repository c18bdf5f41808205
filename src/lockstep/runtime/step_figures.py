"""What both wrappers show of their steps, and torch's sync toggle, read from the driver.

`StepFigures` gives a wrapper `stats` (the last synchronised step's `StepStats`)
and `add_step_observer` (the tracer and the Monitor use it); `SyncToggle` gives
it torch's `require_backward_grad_sync` switch and `no_sync()`. Both engines
inherit them, so each guarantee exists once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lockstep.runtime.driver import BackwardDriver, StepObserver
from lockstep.runtime.step_stats import StepStats


class StepFigures:
    """Mixed into a wrapper whose `step_driver` runs its backward."""

    @property
    def step_driver(self) -> BackwardDriver:
        raise NotImplementedError

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer(stats)` at the end of every synchronised step (after averaging).

        Observers run inside backward's final callback, so they must be cheap; the
        tracer and the monitor use this to see every step without extra clock reads.
        """
        self.step_driver.observers.append(observer)

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last synchronised step, or None before the first."""
        return self.step_driver.last_stats


class SyncToggle:
    """torch's switch: `require_backward_grad_sync = False` (or `no_sync()`) accumulates."""

    require_backward_grad_sync: bool = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forward and backward inside skip the collectives.

        The same switch as `require_backward_grad_sync = False`; the next forward-backward
        outside the context reduces the accumulated sum.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
