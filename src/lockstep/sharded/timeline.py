"""What the sharded engine did when: spans of forward, backward and each collective.

Off unless a `Timeline` is attached (`model.timeline = Timeline()`). The engine
records a span per phase (forward, backward) and per collective (all-gather of
a unit, reduce-scatter or all-reduce of a flat) from launch to the first moment
it was seen finished (handles are polled at every hook, so the end is a close
upper bound). `benchmarks/sharded_timeline.py` draws them as lanes: overlap is
a collective bar under a compute bar.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lockstep.runtime.handles import CollectiveHandle


@dataclass
class Span:
    """One bar: `lane` (compute, all-gather, reduce), a label, and perf_counter() times."""

    lane: str
    label: str
    start: float
    end: float = 0.0


@dataclass
class Timeline:
    """Spans recorded in order; collectives are closed when their handle is seen done."""

    spans: list[Span] = field(default_factory=list)
    _open: list[tuple[Span, CollectiveHandle]] = field(default_factory=list)

    def begin(self, lane: str, label: str) -> Span:
        span = Span(lane, label, time.perf_counter())
        self.spans.append(span)
        return span

    def end(self, span: Span) -> None:
        span.end = time.perf_counter()

    def collective(self, lane: str, label: str, handle: CollectiveHandle, start: float) -> None:
        """Record a collective launched at `start`; it closes when `poll` sees it done."""
        span = Span(lane, label, start)
        self.spans.append(span)
        self._open.append((span, handle))
        self.poll()

    def poll(self) -> None:
        """Close the spans of collectives that have finished."""
        still = []
        for span, handle in self._open:
            if handle.poll():
                span.end = handle.done_at
            else:
                still.append((span, handle))
        self._open = still
