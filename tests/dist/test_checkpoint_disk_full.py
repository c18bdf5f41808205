"""A checkpoint write that fills the disk: a real, tiny tmpfs, two ranks.

The file system is a 64 KiB tmpfs mounted for the test (needs root; skipped with
the reason otherwise). The first checkpoint fits, the second does not: every
rank must get an error naming the directory, the bytes needed and free, and
"No space left on device"; no partial file may stay; the first checkpoint must
remain the one restore() uses.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep import Checkpointer
from lockstep.errors import CheckpointError
from lockstep.testing import run_ranks

DISK_BYTES = 64 * 1024


def _model(value: float, width: int = 80) -> nn.Module:
    model = nn.Linear(
        width, width
    )  # with the random states, about 56 KB a checkpoint: one fits, two do not
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(-value)
    return model


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs at tmp_path/disk, unmounted afterwards."""
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root (this process runs as uid {os.geteuid()})")
    argv = ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount_point)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], timeout=20, check=False)


def _fill_the_disk(ctx, directory):
    checkpointer = Checkpointer(directory, keep=1)
    checkpointer.save(1, model=_model(1.0))
    try:
        checkpointer.save(2, model=_model(2.0))
    except CheckpointError as error:
        return str(error)
    return None


@pytest.mark.slow  # fills a small file system: make test, not the inner loop
def test_a_full_disk_names_the_cause_removes_the_partial_file_and_keeps_the_last_checkpoint(
    tiny_disk,
):
    messages = run_ranks(_fill_the_disk, 2, str(tiny_disk))
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank}: the save to a full disk did not fail"
        assert f"step_00000002.pt in {tiny_disk} failed: No space left on device" in message
        assert "(errno ENOSPC)" in message
        needed = int(message.split("checkpoint needs ")[1].split(" bytes")[0].replace(",", ""))
        free = int(message.split("; ")[1].split(" of ")[0].replace(",", ""))
        assert needed > free, message
        assert "step 1 (the one `latest` names) stays the restore point" in message
        assert f"(raised on rank {rank})" in message
    assert sorted(p.name for p in Path(tiny_disk).iterdir()) == ["latest", "step_00000001.pt"]
    model = _model(0.0)
    with pytest.warns(UserWarning, match="saved by 2 rank"):
        assert Checkpointer(tiny_disk).restore(model=model) == 1
    assert torch.equal(model.weight, _model(1.0).weight)
    # With the old checkpoint gone (keep=1 prunes it after a save), the next save fits.
    (Path(tiny_disk) / "step_00000001.pt").unlink()
    Checkpointer(tiny_disk, keep=1).save(3, model=_model(3.0))
    assert Checkpointer(tiny_disk).restore(model=model) == 3


def _fill_the_disk_dcp(ctx, directory):
    checkpointer = Checkpointer(directory, keep=1, format="dcp")
    # About 40 KB a checkpoint (the data files, .metadata, the manifest's random states).
    shards = [lockstep.ShardedDataParallel(_model(v, 40), stage=3) for v in (1.0, 2.0)]
    checkpointer.save(1, model=shards[0])
    try:
        checkpointer.save(2, model=shards[1])
    except CheckpointError as error:
        return str(error)
    return None


def _restore_dcp(ctx, directory):
    model = lockstep.ShardedDataParallel(_model(0.0, 40), stage=3)
    step = Checkpointer(directory, format="dcp").restore(model=model)
    return step, model.state_dict()["weight"]


def test_a_dcp_write_that_fills_the_disk_fails_on_every_rank_and_keeps_the_last(tiny_disk):
    """format="dcp": every rank writes; the one that cannot makes every rank raise."""
    messages = run_ranks(_fill_the_disk_dcp, 2, str(tiny_disk))
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank}: the save to a full disk did not fail"
        assert "writing checkpoint step 2" in message and "No space left on device" in message
        assert f"(raised on rank {rank})" in message
    assert sorted(p.name for p in Path(tiny_disk).iterdir()) == ["latest", "step_00000001"]
    (step, weight), _ = run_ranks(_restore_dcp, 2, str(tiny_disk))
    assert step == 1 and torch.equal(weight, _model(1.0, 40).weight)
