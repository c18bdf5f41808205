"""The straggler report names the rank that was slowed on purpose.

Two gloo ranks train a small MLP for three windows of four steps (a report
every four steps): in the first nobody is slowed; in the second rank 1 sleeps
inside its forward (a slow model replica); in the third rank 0 sleeps before
its forward (slow data loading, invisible in its own step-relative times, but
not once the ranks are aligned on the end of the step's all-reduce).
"""

from __future__ import annotations

import time

import torch
from torch import nn

import lockstep
from lockstep.testing import run_ranks

WINDOW, SLEEP_S = 4, 0.08


class Sleepy(nn.Module):
    """An MLP whose forward sleeps `delay` seconds first (0: no sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 4))
        self.delay = 0.0

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        return self.net(x)


def _train(ctx):
    torch.manual_seed(0)
    model = Sleepy()
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    monitor = lockstep.Monitor(
        ddp, ctx, optimizer=opt, straggler_every=WINDOW, progress=False, log_every=100, trace=False
    )
    for step in range(3 * WINDOW):
        window = step // WINDOW
        model.delay = SLEEP_S if window == 1 and ctx.rank == 1 else 0.0
        if window == 2 and ctx.rank == 0:
            time.sleep(SLEEP_S)  # "data loading"
        ddp(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        monitor.step(batch_size=4)
    monitor.close()
    return monitor.reports, len(ddp.stats.buckets)


def test_straggler_report_names_the_slowed_rank():
    (reports, buckets), (reports_1, _) = run_ranks(_train, 2)
    assert reports == reports_1  # every rank holds the same report
    assert buckets >= 2 and len(reports) == 3
    assert [(r.first_step, r.last_step) for r in reports] == [(1, 4), (5, 8), (9, 12)]
    slow_model, slow_data = reports[1], reports[2]
    assert slow_model.rank == 1 and slow_model.significant
    assert slow_model.wait_seconds >= SLEEP_S / 2
    assert slow_model.last_share >= 0.75
    assert "rank 1 made the others wait" in slow_model.describe()
    assert slow_data.rank == 0 and slow_data.significant
    assert slow_data.wait_seconds >= SLEEP_S / 2
    for report in reports:
        assert 0 <= report.bucket < buckets and len(report.rank_waits) == 2
