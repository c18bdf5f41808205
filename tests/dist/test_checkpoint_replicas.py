"""Checkpoints that vouch for themselves: committed only when every rank holds the same state.

Real gloo ranks, with the engine's step check switched off so that the checkpoint's
own check is what is shown. After its optimizer's step 3 one rank's replica is made
to differ: one bit of a weight flipped, or one entry of its optimizer's momentum
changed (which no parameter shows yet). Every save from then on must fail on every
rank naming the ranks and the first entry that differs, and `latest` must still name
step 3. At restore, one rank reads another file than the others (its own disk holds
step 2's file where the others hold step 3's): every rank raises naming it. With the
check off (LOCKSTEP_CHECK_REPLICAS=0) the saves are committed and the restore passes,
and the tests fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_models import MLP

import lockstep
from lockstep.errors import CheckpointError
from lockstep.testing import run_ranks

pytestmark = pytest.mark.slow  # three 2-rank jobs with saves: make test, not the inner loop

STEPS, FAULT_STEP = 5, 3


def _train(ctx, directory: str, kind: str, steps: int = STEPS) -> tuple[Any, Any, dict]:
    torch.manual_seed(0)
    model = MLP()
    ddp = lockstep.DistributedDataParallel(model, check_replicas=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ckpt = lockstep.Checkpointer(directory, keep=10, timeout_s=20)
    refused = {}
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(100 * step + ctx.rank)
        loss = ((ddp(torch.randn(4, 8, generator=gen)) - 1.0) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == FAULT_STEP and ctx.rank == 1 and kind == "weight":
            with torch.no_grad():
                model.net[2].weight.view(-1).view(torch.int32)[7] ^= 1 << 12
        if step == FAULT_STEP and ctx.rank == 1 and kind == "optimizer":
            opt.state[model.net[0].weight]["momentum_buffer"][1, 2] += 1e-3
        try:
            ckpt.save(step, model=ddp, optimizer=opt)
        except CheckpointError as error:
            refused[step] = str(error)
    return ddp, opt, refused


def _save(ctx, directory: str, kind: str) -> dict:
    return _train(ctx, directory, kind)[2]


def _committed(directory: Path) -> str:
    return (directory / "latest").read_text().strip()


def test_a_weight_that_differs_on_one_of_two_ranks_is_never_committed(tmp_path):
    for rank, refused in enumerate(run_ranks(_save, 2, str(tmp_path), "weight", deadline_s=120)):
        assert sorted(refused) == [FAULT_STEP, FAULT_STEP + 1, FAULT_STEP + 2], (rank, refused)
        error = refused[FAULT_STEP]
        assert "rank 0 refused to commit checkpoint step 3: the replicas differ" in error, error
        assert "rank(s) [0, 1] hold different states and no majority agrees" in error, error
        assert "the first that differs is parameter 'net.2.weight'" in error, error
        assert "The last checkpoint every rank agreed on (step 2) stays `latest`" in error, error
    assert _committed(tmp_path) == "step_00000002.pt"


def test_an_optimizer_state_entry_changed_on_one_rank_is_named_at_the_save(tmp_path):
    for rank, refused in enumerate(run_ranks(_save, 3, str(tmp_path), "optimizer", deadline_s=120)):
        assert FAULT_STEP in refused, (rank, refused)
        error = refused[FAULT_STEP]
        assert "rank(s) [1] hold another state than the majority, rank(s) [0, 2]" in error, error
        where = "the first that differs is optimizer state 'momentum_buffer' of 'net.0.weight'"
        assert where in error, error
    assert _committed(tmp_path) == "step_00000002.pt"


class OwnDisk:
    """A rank's view of the checkpoint directory on its own disk: `swapped` maps a path
    to the file this disk holds there instead (every other call goes to `files`)."""

    def __init__(self, files: Any, swapped: dict[Path, Path]) -> None:
        self.files, self.swapped = files, swapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)

    def load(self, path: Path, map_location: Any, *, verify: bool = True) -> dict[str, Any]:
        return self.files.load(self.swapped.get(path, path), map_location, verify=verify)


def _restore_swapped(ctx, directory: str) -> str | None:
    _train(ctx, directory, "", steps=3)
    torch.manual_seed(1)
    model = lockstep.DistributedDataParallel(MLP(), check_replicas=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reader = lockstep.Checkpointer(directory, timeout_s=20)
    if ctx.rank == 1:
        reader.files = OwnDisk(reader.files, {reader.files.path_for(3): reader.files.path_for(2)})
    try:
        reader.restore(model=model, optimizer=opt)
    except CheckpointError as error:
        return str(error)
    return None


def test_a_checkpoint_file_swapped_on_one_ranks_disk_is_named_at_restore(tmp_path):
    for rank, error in enumerate(run_ranks(_restore_swapped, 3, str(tmp_path), deadline_s=120)):
        assert error is not None, rank
        assert "after loading" in error and "step_00000003.pt" in error, error
        assert "rank(s) [1] hold another state than the majority, rank(s) [0, 2]" in error, error
        assert f"raised on rank {rank}" in error, error
