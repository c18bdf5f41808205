"""A collective that failed is an error, not a finished step.

gloo marks a work whose peer vanished as completed, with an exception. The
backward driver polls works at each gradient hook (`runtime/handles.py`); a
poll that took "completed" for success would let the step end with gradients
that were never averaged, and the rank would apply an update no other rank
applied. Here rank 1 leaves inside its first backward, after the step's fingerprint
went out and before its gradient bucket did: rank 0's backward must raise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.testing import RankFailure, run_ranks


def _peer_leaves(ctx, out: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    model = lockstep.DistributedDataParallel(net, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    if ctx.rank == 1:  # gone inside backward, after the step's fingerprint went out
        net[0].weight.register_hook(lambda grad: os._exit(3))
    else:  # the loss of the peer is known before the last bucket is launched and waited
        net[0].weight.register_hook(lambda grad: time.sleep(1.0))
    x = torch.randn(8, 64)
    finished = 0
    try:
        for _ in range(3):
            model(x).sum().backward()
            finished += 1
        seen = "finished"
    except Exception as error:  # the kind and the message are the observation
        seen = f"raised {type(error).__name__} after {finished} step(s): {error}"
    Path(out).write_text(seen)


def test_a_step_whose_all_reduce_failed_raises(tmp_path):
    out = tmp_path / "rank0.txt"
    with pytest.raises(RankFailure):  # rank 1 exited on purpose
        run_ranks(_peer_leaves, 2, str(out), timeout_s=10, deadline_s=60)
    seen = out.read_text()
    assert seen.startswith("raised"), f"rank 0 backward {seen} after its peer left"
