"""`StepState`: everything one synchronised backward changes, in one place.

A step goes through four named states, each the work of one `BackwardDriver`
method (`runtime/driver.py`), for both engines:

| state | entered by | what happens |
|---|---|---|
| armed | `BackwardDriver.arm` (forward's end) | a fresh `StepState`; buckets reset |
| started | `BackwardDriver.start` (first hook) | backward noted, `_finalize` queued |
| filling | `BackwardDriver.filled` (each hook) | buckets launched in order; fingerprint last |
| finalized | `BackwardDriver._finalize` (autograd done) | waits, results, `StepStats`; dropped |

Outside a synchronised backward the driver holds no `StepState` (the engines'
hooks do nothing), so nothing of one step can leak into the next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lockstep.runtime.bucket import Bucket
from lockstep.runtime.fingerprint import Fingerprint


@dataclass
class StepState:
    """The per-step state of gradient synchronisation.

    Attributes:
        forward_start: perf_counter() when the wrapper's forward began.
        forward_end: perf_counter() when it returned.
        unused: parameters the forward did not reach; marked ready when backward starts.
        marked: per parameter: its gradient reached its slot this step.
        used: per parameter: a hook fired for it locally (find_unused_parameters).
        fingerprint: what this rank says about the step (checked across ranks).
        without_grad: parameters marked with no gradient (zeros in their slot).
        copy_back: parameters whose `.grad` carries a graph: the average is copied into it.
        started: the first hook has run and `_finalize` is queued.
        next_bucket: index of the next bucket to launch (launches go in index order).
        in_flight: launched buckets whose collective is not yet seen finished, oldest first.
        fingerprint_sent: the step fingerprint (with the non-finite verdict) is out.
        reduced: the waits saw every launched bucket's collective finish on this rank.
        checked: the step fingerprint, the step's last collective, finished and matched.
    """

    forward_start: float
    forward_end: float
    unused: list[int]
    marked: list[bool]
    used: list[bool]
    fingerprint: Fingerprint
    without_grad: list[int] = field(default_factory=list)
    copy_back: list[int] = field(default_factory=list)
    started: bool = False
    next_bucket: int = 0
    in_flight: deque[Bucket] = field(default_factory=deque)
    fingerprint_sent: bool = False
    reduced: bool = False
    checked: bool = False

    @classmethod
    def armed(
        cls,
        num_params: int,
        unused: list[int],
        forward_start: float,
        forward_end: float,
        fingerprint: Fingerprint,
    ) -> StepState:
        flags = [False] * num_params
        return cls(forward_start, forward_end, unused, flags, list(flags), fingerprint)
