"""DCP checkpoints are complete or absent, and a damaged one is found before it is read.

Real processes at world size 2, a stage-3 model: rank 0 stops itself (os._exit)
at each point of a commit and the folder it leaves is restored from; data files
are truncated or have a byte flipped, and every rank must name the file (the
newest checkpoint skipped with a warning, or an error on every rank when none is
left), never hang; a NaN on one rank is never committed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint.dcp_files import MANIFEST, POINTS
from lockstep.errors import CheckpointError
from lockstep.testing import RankFailure, run_ranks

pytestmark = pytest.mark.slow


def _model(value: float) -> lockstep.ShardedDataParallel:
    module = nn.Linear(5, 3)  # 18 elements: each rank holds 9, rows cut in the middle
    with torch.no_grad():
        module.weight.fill_(value)
        module.bias.fill_(-value)
    return lockstep.ShardedDataParallel(module, stage=3)


def _save(ctx, directory: str, steps: list[int], crash_at: str | None = None, keep: int = 3):
    checkpointer = lockstep.Checkpointer(directory, format="dcp", keep=keep, timeout_s=20)
    for step in steps:
        if step == steps[-1] and crash_at is not None:
            checkpointer.files.on_point = lambda name: _crash(ctx, name, crash_at, directory)
        checkpointer.save(step, model=_model(float(step)))


def _crash(ctx, name: str, point: str, directory: str) -> None:
    if name != point or ctx.rank != 0:
        return
    if point == "data_written":  # the write itself was cut short, too
        (data,) = Path(directory).glob(".step_*.tmp/__0_0.distcp")
        os.truncate(data, data.stat().st_size // 2)
    os._exit(17)


def _restore(ctx, directory: str) -> dict:
    model = _model(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = lockstep.Checkpointer(directory, format="dcp").restore(model=model)
        except CheckpointError as error:
            return {"error": str(error)}
    weight = model.state_dict()["weight"]
    return {"step": step, "value": weight[0, 0].item(), "notes": [str(w.message) for w in caught]}


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_any_point_of_a_commit_leaves_a_complete_checkpoint(tmp_path, point):
    with pytest.raises(RankFailure, match="exit code 17"):
        run_ranks(_save, 2, str(tmp_path), [1, 2], point, deadline_s=60)
    committed = point == "pointer_updated"
    results = run_ranks(_restore, 2, str(tmp_path))
    for out in results:
        assert (out["step"], out["value"]) == ((2, 2.0) if committed else (1, 1.0)), out
    notes = " ".join(results[0]["notes"])  # rank 0 reports what it passed over
    if point in ("data_written", "manifest_written"):
        assert ".step_00000002.tmp left by an interrupted save" in notes
    if point in ("renamed", "pointer_written"):
        assert "interrupted before latest named it" in notes
    run_ranks(_save, 2, str(tmp_path), [3], None, 1)  # the next save cleans up the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003"]


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, path.stat().st_size - 7)
    else:  # one byte flipped near the end, where the tensors are
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "victim"), [("truncated", "__1_0.distcp"), ("flipped", "__0_0.distcp")]
)
def test_a_damaged_data_file_is_named_on_every_rank(tmp_path, how, victim):
    run_ranks(_save, 2, str(tmp_path), [1, 2])
    bad = tmp_path / "step_00000002" / victim
    _damage(bad, how)
    results = run_ranks(_restore, 2, str(tmp_path))
    assert [(r["step"], r["value"]) for r in results] == [(1, 1.0), (1, 1.0)]
    assert any(str(bad) in note for note in results[0]["notes"]), results[0]["notes"]
    _damage(tmp_path / "step_00000001" / victim, how)  # now none is left
    for out in run_ranks(_restore, 2, str(tmp_path), deadline_s=60):
        assert "no valid checkpoint" in out["error"] and str(bad) in out["error"], out
        assert ("truncated" if how == "truncated" else "corrupt") in out["error"]


def test_a_truncated_file_of_a_checkpoint_without_manifest_is_found_from_the_metadata(tmp_path):
    run_ranks(_save, 2, str(tmp_path), [1])
    (tmp_path / "step_00000001" / MANIFEST).unlink()  # as torch's dcp.save leaves a folder
    assert run_ranks(_restore, 2, str(tmp_path))[0]["step"] == 1
    bad = tmp_path / "step_00000001" / "__1_0.distcp"
    _damage(bad, "truncated")
    for out in run_ranks(_restore, 2, str(tmp_path)):
        assert f"{bad} is truncated" in out["error"], out


def _save_nan(ctx, directory: str) -> str:
    checkpointer = lockstep.Checkpointer(directory, format="dcp")
    checkpointer.save(1, model=_model(1.0))
    model = _model(2.0)
    if ctx.rank == 1:
        with torch.no_grad():
            model.shards[0][-1] = float("nan")  # only rank 1's shard
    try:
        checkpointer.save(2, model=model)
    except CheckpointError as error:
        return str(error)
    return "saved"


def test_a_nan_on_one_rank_is_never_committed(tmp_path):
    for message in run_ranks(_save_nan, 2, str(tmp_path)):
        assert "not written" in message and "NaN on rank 1" in message, message
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()


def _extras(ctx, directory: str, save: bool) -> dict:
    model = _model(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    checkpointer = lockstep.Checkpointer(directory, format="dcp")
    if save:
        scheduler.step()
        torch.manual_seed(10 + ctx.rank)
        checkpointer.save(4, model=model, optimizer=opt, scheduler=scheduler, extra={"k": 7})
        return {"draw": torch.rand(3)}
    torch.manual_seed(99)
    step = checkpointer.restore(model=model, optimizer=opt, scheduler=scheduler)
    lr = opt.param_groups[0]["lr"]
    return {"step": step, "extra": checkpointer.extra, "lr": lr, "draw": torch.rand(3)}


def test_scheduler_extra_and_each_ranks_random_state_come_back(tmp_path):
    saved = run_ranks(_extras, 2, str(tmp_path), True)
    for rank, out in enumerate(run_ranks(_extras, 2, str(tmp_path), False)):
        assert (out["step"], out["extra"], out["lr"]) == (4, {"k": 7}, 0.25)
        assert torch.equal(out["draw"], saved[rank]["draw"]), f"rank {rank}'s generator"


def _restore_other_model(ctx, directory: str) -> str:
    model = lockstep.ShardedDataParallel(nn.Linear(5, 4), stage=3)
    try:
        lockstep.Checkpointer(directory, format="dcp").restore(model=model)
    except CheckpointError as error:
        return str(error)
    return "restored"


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(tmp_path):
    run_ranks(_save, 2, str(tmp_path), [1])
    for message in run_ranks(_restore_other_model, 2, str(tmp_path)):
        assert "does not fit this model" in message, message
        assert "weight: checkpoint (3, 5) vs model (4, 5)" in message
