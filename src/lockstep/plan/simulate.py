"""Replay one step of the engine on a profile: buckets launched at ready time, one link, in series.

Pure arithmetic, no processes. The buckets are those the engine builds: the
engine's own `assign_buckets`, over the parameters in the order their gradients
became ready (the rebuild after the first step). A bucket is ready when its last
gradient is; buckets launch in index order (the engine's rule, so every rank
issues the same collectives), and the all-reduces of one link run one at a time.
While backward still computes, communication runs `slowdown` times slower (on CPU
both compete for the same cores; 1.0 where communication has its own hardware,
as on GPUs). The step ends when backward and the last all-reduce are done, then
the optimizer runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lockstep.plan.profile import StepProfile
from lockstep.runtime.bucketing import MB, ParamSpec, assign_buckets

BucketSeconds = Callable[[int], float]


def engine_buckets(
    profile: StepProfile,
    first_cap_bytes: int = 1 * MB,
    cap_bytes: int = 25 * MB,
    rebuilt: bool = True,
) -> list[list[int]]:
    """The engine's buckets for the profiled parameters, in launch order.

    Args:
        profile: the step profile; a trace's profile is already one entry per bucket.
        first_cap_bytes: the engine's first bucket cap.
        cap_bytes: its cap for the others.
        rebuilt: bucket in observed ready order (every step after the first), else in
            reverse registration order (the first step).
    """
    params = profile.params
    if profile.prebucketed:
        return [[i] for i in range(len(params))]
    cpu = torch.device("cpu")
    specs = [
        ParamSpec(i, p.name, p.numel, p.element_size, getattr(torch, p.dtype, torch.uint8), cpu)
        for i, p in enumerate(params)
    ]
    # Ties (equal medians) fall back to reverse registration order, backward's usual order.
    order = sorted(range(len(params)), key=lambda i: (params[i].ready_s, -i)) if rebuilt else None
    return assign_buckets(specs, order, first_cap_bytes=first_cap_bytes, cap_bytes=cap_bytes)


@dataclass(frozen=True)
class SimBucket:
    """One bucket of the predicted step; times in seconds from the start of forward."""

    index: int
    nbytes: int
    params: tuple[int, ...]
    ready: float
    launched: float
    started: float
    done: float


@dataclass(frozen=True)
class SimStep:
    """The predicted step (seconds).

    Attributes:
        forward_s, backward_s, optimizer_s: compute phases, as profiled.
        buckets: the all-reduces, in launch order.
        slowdown: the factor applied to communication while backward computes.
        tail_s: communication after the optimizer that nothing hides (ZeRO's all-gather).
    """

    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: tuple[SimBucket, ...]
    slowdown: float = 1.0
    tail_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def backward_end(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def comm_end(self) -> float:
        return max((b.done for b in self.buckets), default=0.0)

    @property
    def exposed_s(self) -> float:
        """Time after backward spent waiting for all-reduces (what the engine calls exposed)."""
        return max(0.0, self.comm_end - self.backward_end)

    @property
    def step_s(self) -> float:
        return self.backward_end + self.exposed_s + self.optimizer_s + self.tail_s

    @property
    def comm_s(self) -> float:
        """Time the link was busy: the sum over buckets of start-to-done."""
        return sum(b.done - b.started for b in self.buckets)

    @property
    def overlap(self) -> float:
        """Share of the communication span hidden behind backward (as `StepStats.overlap`)."""
        if not self.buckets:
            return 1.0
        span = self.comm_end - min(b.launched for b in self.buckets)
        return 1.0 if span <= 0 else max(0.0, min(1.0, 1.0 - self.exposed_s / span))

    @property
    def critical_bucket(self) -> int | None:
        """The bucket that opens the last back-to-back run of all-reduces on the link.

        The step's communication ends at this bucket's launch plus the link time of it
        and every later bucket; None when nothing is exposed (backward is the path).
        """
        if not self.buckets or self.exposed_s <= 0:
            return None
        k = len(self.buckets) - 1
        while k > 0 and self.buckets[k - 1].done >= self.buckets[k].launched:
            k -= 1
        return self.buckets[k].index


def finish_time(start: float, work_s: float, backward_end: float, slowdown: float) -> float:
    """When `work_s` of link time that starts at `start` is done.

    Before `backward_end` it progresses at 1/slowdown of full speed, after it at full speed.
    """
    if start >= backward_end or slowdown == 1.0:
        return start + work_s
    window = backward_end - start
    if work_s * slowdown <= window:
        return start + work_s * slowdown
    return backward_end + work_s - window / slowdown


def simulate(
    profile: StepProfile,
    layout: Sequence[Sequence[int]],
    bucket_seconds: BucketSeconds,
    slowdown: float = 1.0,
) -> SimStep:
    """Predict the step of `profile` with buckets `layout` on a link.

    Args:
        profile: forward, backward, optimizer times and each parameter's ready time.
        layout: buckets in launch order, as lists of indices into `profile.params`.
        bucket_seconds: link time of one bucket's collective, from its bytes.
        slowdown: >= 1; communication runs this much slower while backward computes.

    Raises:
        ValueError: slowdown below 1, or a layout that does not cover every parameter once.
    """
    if slowdown < 1.0:
        raise ValueError(f"the communication slowdown must be >= 1.0; found {slowdown}")
    if sorted(i for bucket in layout for i in bucket) != list(range(len(profile.params))):
        raise ValueError("the bucket layout must hold every profiled parameter exactly once")
    backward_end = profile.forward_s + profile.backward_s
    buckets, launched, link_free = [], 0.0, 0.0
    for index, members in enumerate(layout):
        nbytes = sum(profile.params[i].nbytes for i in members)
        ready = profile.forward_s + max(profile.params[i].ready_s for i in members)
        launched = max(ready, launched)
        started = max(launched, link_free)
        link_free = finish_time(started, bucket_seconds(nbytes), backward_end, slowdown)
        bucket = SimBucket(index, nbytes, tuple(members), ready, launched, started, link_free)
        buckets.append(bucket)
    return SimStep(
        profile.forward_s, profile.backward_s, profile.optimizer_s, tuple(buckets), slowdown
    )
