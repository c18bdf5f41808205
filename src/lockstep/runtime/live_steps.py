"""The backward driver's part in live recovery: the step's local gradients kept, the
interrupted step finished with the new generation.

`BackwardDriver` (`runtime/driver.py`) copies each bucket's local gradients when it
launches it (`keep`); when a wait of the step fails because a rank was lost,
`recover` joins the next generation (`runtime/live.py`), lets the donor hand the
state over, and runs the step's buckets and fingerprint again from the copies (in
the order of the first launch), with the replacement, which resumes at this step.
docs/multinode.md, "Live recovery".
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from lockstep.errors import LockstepError
from lockstep.runtime import live, waits

if TYPE_CHECKING:
    from lockstep.runtime.bucket import Bucket
    from lockstep.runtime.bucket_collective import BucketCollective
    from lockstep.runtime.fingerprint import StepFingerprint
    from lockstep.runtime.step import StepState


class Driver(Protocol):
    """What the recovery uses of `BackwardDriver` (which imports this module)."""

    buckets: list[Bucket]
    collective: BucketCollective
    fingerprint: StepFingerprint
    sink: Any
    steps: int

    def fingerprint_after_launch(self, step: StepState) -> None: ...

    def check_fingerprint(self, step: StepState) -> None: ...


class LiveSteps:
    """One driver's part: copies of the step's local gradients, and the recovery."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}  # by launch position, reused step to step
        waits.interrupt_with(live.announced)

    def keep(self, position: int, buffer: torch.Tensor) -> None:
        """A bucket is about to be launched: copy its local (not yet reduced) gradients.

        The copy goes into the buffer of the last step's bucket at that position (no
        allocation per step: a fresh gradient-sized tensor each step costs page faults).
        """
        kept = self.kept.get(position)
        if kept is None or kept.shape != buffer.shape or kept.dtype != buffer.dtype:
            self.kept[position] = buffer.clone()
        else:
            kept.copy_(buffer)

    def recover(self, driver: Driver, step: StepState, error: BaseException) -> None:
        """Finish the interrupted step with the new generation, or re-raise `error`."""
        if isinstance(error, LockstepError):
            raise error
        start = time.monotonic()
        replaced = live.rejoin(error)
        live.hand_over(replaced, within_step=True)
        self._relaunch(driver, step)
        print(
            f"lockstep [rank {dist.get_rank()}]: live recovery: generation "
            f"{live.generation()}, rank(s) {replaced} replaced; step {driver.steps + 1} "
            f"finished again after {time.monotonic() - start:.2f} s standing still",
            file=sys.stderr,
            flush=True,
        )

    def _relaunch(self, driver: Driver, step: StepState) -> None:
        """The step's buckets and fingerprint again, from the kept local gradients."""
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
