"""Checkpointer across ranks: errors reach every rank, and waiting ranks say what they awaited.

Only rank 0 writes; the other ranks wait for it at a barrier whose timeout
names the save they were waiting for. (That checkpoints of wrapped and plain
models interchange is tested in test_resume.py, in a spawn that is paid for there.)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from lockstep import Checkpointer
from lockstep.errors import CheckpointError
from lockstep.testing import RankFailure, run_ranks


def make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def _errors(ctx, directory):
    """Bad input on two ranks: each must raise on every rank, not only on rank 0."""
    messages = []
    blocker = Path(directory) / "a-file"
    if ctx.rank == 0:
        blocker.write_text("")
    attempts = [
        lambda: Checkpointer(blocker / "ckpt").save(1, model=make(1)),
        lambda: Checkpointer(directory).save(1, model=make(1), extra={"f": len}),
        lambda: Checkpointer(Path(directory) / "good").save(1, model=make(1)),
        lambda: Checkpointer(Path(directory) / "good").restore(model=nn.Linear(3, 4)),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append(None)
        except CheckpointError as error:
            messages.append(str(error))
    return messages


def test_bad_input_raises_the_same_error_on_every_rank(tmp_path):
    results = run_ranks(_errors, 2, str(tmp_path))
    unwritable, unsafe, fine, mismatch = zip(*results, strict=True)
    assert fine == (None, None)
    for pair in (unwritable, unsafe, mismatch):
        assert pair[0] is not None and pair[1] is not None
        assert pair[0].replace("on rank 0", "on rank 1") == pair[1].replace(
            "on rank 0", "on rank 1"
        )
    assert f"in {tmp_path / 'a-file' / 'ckpt'}" in unwritable[1]
    assert "Expected a writable directory" in unwritable[1]
    assert "checkpoint['extra']['f']" in unsafe[1]
    assert "step_00000001.pt does not fit this model" in mismatch[1]
    assert "rank(s) [0, 1]" in mismatch[0]


def _slow_rank0(ctx, directory):
    checkpointer = Checkpointer(directory, timeout_s=1)
    if ctx.rank == 0:
        checkpointer.files.on_point = lambda point: (
            time.sleep(2.5) if point == "temp_synced" else None
        )
    checkpointer.save(1, model=make(1))


def test_ranks_that_time_out_say_they_were_waiting_for_rank_0s_save(tmp_path):
    start = time.monotonic()
    try:
        run_ranks(_slow_rank0, 2, str(tmp_path), timeout_s=20)
    except RankFailure as failure:
        message, failed = str(failure), failure.failed_ranks
    else:
        raise AssertionError("the save should have timed out on rank 1")
    assert 1 in failed
    assert (
        "rank 1 timed out after 1 s waiting for rank 0's checkpoint save of step 1 to "
        f"{tmp_path}" in message
    )
    assert time.monotonic() - start < 30
