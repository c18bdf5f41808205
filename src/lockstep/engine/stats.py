"""`StepStats`: what one synchronised step did, measured by the engine itself.

The reducer stamps each bucket when it became ready, when its all-reduce was
launched and when it finished; the wrapper stamps forward and backward. From
those few `perf_counter()` readings per bucket come the figures people ask
about: how long the all-reduces took, how much of that hid behind backward,
and how many bytes went on the wire. Recording costs a handful of clock reads
per bucket, so it is always on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ring_wire_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `payload_bytes`: 2(N-1)/N x payload."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * payload_bytes // world_size


@dataclass(frozen=True)
class BucketRecord:
    """One bucket's step, times in seconds from the start of the step's forward."""

    index: int
    nbytes: int
    num_params: int
    ready: float
    launched: float
    done: float

    @property
    def comm_seconds(self) -> float:
        return self.done - self.launched


@dataclass(frozen=True)
class StepStats:
    """Figures of the last synchronised step (times in seconds).

    Attributes:
        step: count of synchronised backwards so far, this one included.
        world_size: ranks that took part.
        forward_seconds: the wrapped module's forward.
        backward_seconds: from the end of forward to the end of autograd's work.
        payload_bytes: gradient bytes handed to the all-reduce (or to the comm hook).
        wire_bytes: bytes each rank put on the wire (ring figure, or what the hook reported).
        comm_seconds: sum over buckets of launch-to-done time.
        exposed_seconds: time backward waited for communication after autograd finished.
        buckets: per-bucket records.
        start: perf_counter() at the start of the step's forward (the records' origin).
    """

    step: int
    world_size: int
    forward_seconds: float
    backward_seconds: float
    payload_bytes: int
    wire_bytes: int
    comm_seconds: float
    exposed_seconds: float
    buckets: tuple[BucketRecord, ...] = field(default_factory=tuple)
    start: float = 0.0

    @property
    def overlap(self) -> float:
        """Share of the all-reduce time hidden behind backward, in [0, 1]."""
        span = self.comm_span_seconds
        if span <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.exposed_seconds / span))

    @property
    def comm_span_seconds(self) -> float:
        """Wall time from the first launch to the last completion."""
        if not self.buckets:
            return 0.0
        return max(b.done for b in self.buckets) - min(b.launched for b in self.buckets)
