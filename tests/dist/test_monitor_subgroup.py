"""A Monitor on a model that trains on a subgroup describes that subgroup.

World 4, two models, each on its own 2-rank subgroup ({0, 1} and {2, 3}). The
straggler window is exchanged within the model's group: every report has one
entry per rank of the subgroup, and the loss and samples are the subgroup's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.testing import run_ranks


def _subgroup_monitor(ctx) -> dict:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[ctx.rank // 2]
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(nn.Linear(4, 2), process_group=group)
    monitor = lockstep.Monitor(model, ctx, log_every=2, straggler_every=2, progress=False)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step + 10 * ctx.rank))
        loss = model(x).sum()
        loss.backward()
        metrics = monitor.step(loss, batch_size=3)
    monitor.close()
    report = monitor.reports[-1] if monitor.reports else None
    return {
        "waits": len(report.rank_waits) if report else None,
        "samples": metrics.samples,
    }


def test_the_monitor_of_a_model_on_a_subgroup_compares_that_subgroup():
    for result in run_ranks(_subgroup_monitor, 4, deadline_s=120):
        assert result == {"waits": 2, "samples": 6}, result
