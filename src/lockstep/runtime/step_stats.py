"""`StepStats`: what one synchronised step did, measured by the engine itself.

The backward driver stamps each bucket when it became ready, when its all-reduce was
launched and when it finished; the wrapper stamps forward and backward. From
those few `perf_counter()` readings per bucket come the figures people ask
about: how long the all-reduces took, how much of that hid behind backward,
and how many bytes went on the wire. Recording costs a handful of clock reads
per bucket, so it is always on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.runtime.bucket import Bucket


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
        wire_bytes: bytes each rank put on the wire (ring figure, what the hook reported,
            or what a collective that counts its sends counted: `wire_levels` summed).
        comm_seconds: sum over buckets of launch-to-done time.
        exposed_seconds: time backward waited for communication after autograd finished.
        buckets: per-bucket records.
        start: perf_counter() at the start of the step's forward (the records' origin).
        wire_levels: bytes per level of a collective that counts its sends, e.g. HSDP's
            ("reduce_scatter", ...) inside the shard group and ("replica_all_reduce", ...)
            across groups; empty otherwise.
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
    wire_levels: tuple[tuple[str, int], ...] = ()

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


@dataclass(frozen=True)
class StepMarks:
    """perf_counter() readings of one step: forward start and end, backward end, finalize end."""

    start: float
    forward_end: float
    backward_end: float
    finalize_end: float


def step_stats(
    step: int,
    world_size: int,
    buckets: Sequence[Bucket],
    marks: StepMarks,
    sent_bytes: int | None,
    wire_levels: dict[str, int] | None = None,
) -> StepStats:
    """Assemble a step's figures from its buckets' stamps.

    Args:
        sent_bytes: what a comm hook handed to collectives; None means the buffers.
        wire_levels: bytes a collective counted as sent, per level; None: the ring figure.
    """
    records = tuple(
        BucketRecord(
            b.index,
            b.nbytes,
            len(b.params),
            b.times.ready - marks.start,
            b.times.launched - marks.start,
            b.times.done - marks.start,
        )
        for b in buckets
    )
    payload = sum(b.nbytes for b in buckets)
    wire = ring_wire_bytes(payload if sent_bytes is None else sent_bytes, world_size)
    if wire_levels is not None:
        wire = sum(wire_levels.values())
    return StepStats(
        step=step,
        world_size=world_size,
        forward_seconds=marks.forward_end - marks.start,
        backward_seconds=marks.backward_end - marks.forward_end,
        payload_bytes=payload,
        wire_bytes=wire,
        comm_seconds=sum(r.comm_seconds for r in records),
        exposed_seconds=marks.finalize_end - marks.backward_end,
        buckets=records,
        start=marks.start,
        wire_levels=tuple((wire_levels or {}).items()),
    )
