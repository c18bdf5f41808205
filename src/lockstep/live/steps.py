"""Live recovery inside a step: the driver's slot (`BackwardDriver.recovery`).

The backward driver (`runtime/driver.py`) holds one slot for "a rank was lost"; the
wing fills it when an engine is wrapped. Each bucket's local gradients are copied
when it launches (`launching`), since its all-reduce overwrites them. When a wait of
the step fails because a rank was lost, `lost` joins the next generation, lets the
donor hand the state over, and runs the step's fingerprint and buckets again from
the copies, with the replacement, which resumes at this step. With three ranks or
more a survivor can still be in the step's fingerprint (its buckets reduced) while
another has finished the step: then nobody runs the step again; this rank takes the
step's outcome from those ahead, ends the step as they did, and at its end skips
what they skipped after it (`live/standing.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lockstep.errors import LockstepError
from lockstep.live import lines, registry
from lockstep.runtime import waits
from lockstep.runtime.recovery import Position

if TYPE_CHECKING:
    from lockstep.runtime.bucket import Bucket
    from lockstep.runtime.driver import BackwardDriver
    from lockstep.runtime.step import StepState


class LiveSteps:
    """One driver's slot: copies of the step's local gradients, and the recovery.

    Args:
        armed: run after each synchronised forward (rank 0 posts its buffers).
    """

    def __init__(self, armed: Callable[[], None]) -> None:
        self.kept: dict[int, torch.Tensor] = {}  # by launch position, reused step to step
        self.armed = armed
        self.caught_up: registry.Recovery | None = None  # a step ended as peers ended it

    def launching(self, position: int, bucket: Bucket) -> None:
        """A bucket is about to be launched: copy its local (not yet reduced) gradients;
        before the first, the wing's in-step posts (`registry.in_step`).

        The copy goes into the buffer of the last step's bucket at that position (no
        allocation per step: a fresh gradient-sized tensor each step costs page faults).
        """
        if position == 0:
            registry.in_step()
        buffer = bucket.buffer
        kept = self.kept.get(position)
        if kept is None or kept.shape != buffer.shape or kept.dtype != buffer.dtype:
            self.kept[position] = buffer.clone()
        else:
            kept.copy_(buffer)

    def layout_changed(self) -> None:
        """The buckets were rebuilt: the copies were the old layout's."""
        self.kept.clear()

    def finished(self) -> None:
        """A synchronised step ended (the random state's and the sampler's copies)."""
        registry.after_step()
        if self.caught_up is not None:
            recovery, self.caught_up = self.caught_up, None
            registry.caught_up(recovery)

    def lost(self, driver: BackwardDriver, step: StepState, error: BaseException) -> None:
        """Finish the interrupted step with the new generation, or re-raise `error`."""
        if isinstance(error, LockstepError):
            raise error
        start = time.monotonic()
        replaced = registry.rejoin(error)
        step_number = driver.steps + 1
        position = Position(None, step_number)
        only_fingerprint = step.reduced and not step.checked
        recovery = registry.hand_over(replaced, position, reduced=only_fingerprint)
        if recovery.ahead:  # they passed the fingerprint: it matched, and no rank flagged a
            driver.fingerprint.settle(0)  # non-finite gradient (that would take a collective)
            self.caught_up = recovery
            where = (
                f"inside step {step_number}, in its fingerprint (its last collective), which "
                f"rank(s) {list(recovery.ahead)} had finished"
            )
            then = f"step {step_number} ended with their outcome, nothing run again"
        else:
            self._relaunch(driver, step)
            where, then = f"inside step {step_number}", f"step {step_number} finished again"
        lines.recovered(registry.generation(), replaced, where, then, time.monotonic() - start)

    def _relaunch(self, driver: BackwardDriver, step: StepState) -> None:
        """The step's buckets and fingerprint again, from the kept local gradients, in the
        order of the first launch."""
        last = len(driver.buckets) - 1
        launched = driver.buckets[: step.next_bucket]
        step.fingerprint_sent = False
        for index, bucket in enumerate(launched):
            bucket.buffer.copy_(self.kept[index])
            bucket.handle = driver.collective.launch(bucket, index == last)
        if step.next_bucket > last:  # as the first launch: after the last bucket
            driver.fingerprint_after_launch(step)
        for bucket in launched:
            assert bucket.handle is not None
            waits.wait(bucket.handle, "gradient bucket", driver.steps + 1, bucket.index, None)
            driver.sink.collected(bucket)
        driver.check_fingerprint(step)
