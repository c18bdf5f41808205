"""The straggler report: which rank made the others wait, by how much, at which bucket.

Each rank keeps, for the steps of a window, when each bucket became ready
(relative to the step's forward) and when its last all-reduce finished. Every
`every` steps the windows are all-gathered and compared. A bucket's all-reduce
cannot finish before the last rank has it ready, so the rank that is ready last
is the one the others wait for. Ranks' clocks are not synchronised: each rank's
times are aligned on the end of the step's last all-reduce, an instant every
rank sees within one message latency, so a rank that starts a step late (slow
data loading) is caught as well as one that computes slowly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.runtime import recovery
from lockstep.runtime.step_stats import StepStats


@dataclass(frozen=True)
class StragglerReport:
    """The comparison of the ranks over one window of steps (times in seconds).

    Attributes:
        first_step: first step of the window.
        last_step: last step of the window.
        rank: the rank the others waited for most.
        bucket: the bucket at which they waited most for it.
        wait_seconds: median over the window of how much later `rank` had `bucket`
            ready than the earliest rank.
        last_share: share of the window's steps in which `rank` was the last ready there.
        rank_waits: per rank, its worst (over buckets) median lateness.
        step_seconds: median time from forward start to the last all-reduce's end.
        significant: whether the wait is worth acting on (above 1 ms and 5% of a step).
    """

    first_step: int
    last_step: int
    rank: int
    bucket: int
    wait_seconds: float
    last_share: float
    rank_waits: tuple[float, ...]
    step_seconds: float
    significant: bool

    def describe(self) -> str:
        """One line for the log."""
        steps = f"steps {self.first_step}-{self.last_step}"
        ms = 1e3 * self.wait_seconds
        if not self.significant:
            return (
                f"straggler check, {steps}: ranks in step (at most {ms:.2f} ms apart, "
                f"rank {self.rank} at bucket {self.bucket})"
            )
        share = self.wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0
        return (
            f"straggler, {steps}: rank {self.rank} made the others wait {ms:.1f} ms at "
            f"bucket {self.bucket} ({share:.0%} of a step; last ready in "
            f"{self.last_share:.0%} of the steps)"
        )

    def to_dict(self) -> dict[str, object]:
        return {"event": "straggler", **self.__dict__, "rank_waits": list(self.rank_waits)}


def analyze(
    ready: torch.Tensor,
    end: torch.Tensor,
    first_step: int,
    last_step: int,
    min_wait_s: float = 1e-3,
) -> StragglerReport:
    """Find the rank the others waited for, from every rank's bucket-ready times.

    Args:
        ready: [ranks, steps, buckets] seconds from each rank's forward start to the
            moment the bucket was ready on that rank.
        end: [ranks, steps] seconds from each rank's forward start to the end of its
            last all-reduce of the step (the alignment point).
        first_step: number of the window's first step.
        last_step: number of the window's last step.
        min_wait_s: waits below this (or below 5% of a step) are not significant.

    Returns:
        The report.
    """
    aligned = ready.double() - end.double().unsqueeze(-1)
    late = aligned - aligned.min(dim=0).values  # >= 0; 0 for the earliest rank
    median = late.median(dim=1).values  # [ranks, buckets]
    rank_waits = median.max(dim=1).values
    rank = int(torch.argmax(rank_waits))
    bucket = int(torch.argmax(median[rank]))
    wait = float(median[rank, bucket])
    at_bucket = late[:, :, bucket]
    last = at_bucket[rank] >= at_bucket.max(dim=0).values
    step_seconds = float(end.double().median())
    return StragglerReport(
        first_step=first_step,
        last_step=last_step,
        rank=rank,
        bucket=bucket,
        wait_seconds=wait,
        last_share=float(last.double().mean()),
        rank_waits=tuple(float(w) for w in rank_waits),
        step_seconds=step_seconds,
        significant=wait > max(min_wait_s, 0.05 * step_seconds),
    )


class StragglerWatch:
    """Keeps this rank's window of bucket-ready times and compares it with the others'.

    Args:
        process_group: the data-parallel group (None: the default group).
        device: where the exchanged tensor lives (the rank's device, for NCCL).
        world_size: ranks in the group.
        rows: the most steps a window holds on any rank (the report's period). Every
            rank sends that many rows, marked present or not, so that a rank with fewer
            steps (a live replacement that joined inside the window) sends the same
            message; the steps every rank has are compared. 0: as many as this rank has.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        device: torch.device,
        world_size: int,
        rows: int = 0,
    ) -> None:
        self.group, self.device, self.world_size = process_group, device, world_size
        self.rows = rows
        self._rows: list[list[float]] = []
        self._steps: list[int] = []
        self._layout: tuple[int, ...] = ()

    def record(self, step: int, stats: StepStats) -> None:
        """Keep a synchronised step's bucket-ready times (local, no communication)."""
        layout = tuple(b.nbytes for b in stats.buckets)
        if layout != self._layout:  # the buckets were rebuilt: start a new window
            self._rows, self._steps, self._layout = [], [], layout
        end = max(b.done for b in stats.buckets)
        self._rows.append([b.ready for b in stats.buckets] + [end])
        self._steps.append(step)

    def exchange_skipped(self) -> None:
        """No exchange for this window (the peers are not there): start a new one."""
        self._rows, self._steps = [], []

    def exchange(self) -> StragglerReport | None:
        """All-gather the window, compare, start a new window; call on every rank at once.

        Returns:
            The report, the same on every rank; None with one rank or an empty window.
        """
        rows, steps = self._rows[-self.rows :] if self.rows else self._rows, self._steps
        self._rows, self._steps = [], []
        if self.world_size < 2 or not rows or not self._layout:
            return None
        width = len(rows[0])
        mine = torch.zeros(max(self.rows, len(rows)), width + 1, dtype=torch.float64)
        mine[-len(rows) :, :width] = torch.tensor(rows, dtype=torch.float64)
        mine[-len(rows) :, width] = 1.0  # present
        mine = mine.to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        outcome = recovery.run(
            recovery.Point.STRAGGLERS,
            steps[-1] if steps else 0,
            lambda: dist.all_gather(gathered, mine, group=self.group, async_op=True),
            group=self.group,
        )
        if not outcome.ran:
            return None  # a rank was lost in it and recovered live: no report this window
        stacked = torch.stack(gathered).cpu()  # [ranks, rows, buckets + 2]
        common = stacked[..., width].min(dim=0).values > 0  # a suffix: the steps all ranks have
        kept = int(common.sum())
        if kept == 0:
            return None
        window = stacked[:, -kept:, :width]  # [ranks, steps, buckets + 1]
        steps = steps[-kept:]
        return analyze(window[..., :-1], window[..., -1], steps[0], steps[-1])
