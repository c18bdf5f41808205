"""Checkpoint files: a crash at any point of a save, corrupt, truncated and unsafe files.

The crashes are real: a spawned process stops itself with os._exit at one point
of its save, and the directory it leaves is then restored from.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lockstep import Checkpointer
from lockstep.checkpoint import rng
from lockstep.checkpoint.files import FORMAT_KEY, FORMAT_VERSION, POINTS
from lockstep.errors import CheckpointError
from lockstep.testing import RankFailure, run_ranks


def model_with(value: float) -> nn.Module:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(-value)
    return model


def restored(directory: Path) -> tuple[int | None, float | None, list[str]]:
    """(step, the weight value, warnings) after restoring `directory` into a fresh model."""
    model = model_with(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = Checkpointer(directory).restore(model=model)
    value = None if step is None else model.weight[0, 0].item()
    return step, value, [str(w.message) for w in caught]


def _crash_at(point: str, directory: Path) -> None:
    if point == "temp_written":  # the write itself was cut short, too
        (tmp,) = directory.glob(".step_*.tmp")
        os.truncate(tmp, tmp.stat().st_size // 2)
    os._exit(17)


def _save_then_crash(ctx, directory, point):
    checkpointer = Checkpointer(directory)
    checkpointer.save(1, model=model_with(1.0))
    checkpointer.files.on_point = lambda name: (
        _crash_at(name, Path(directory)) if name == point else None
    )
    checkpointer.save(2, model=model_with(2.0))


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_any_point_of_a_save_leaves_a_complete_checkpoint(tmp_path, point):
    with pytest.raises(RankFailure, match="exit code 17"):
        run_ranks(_save_then_crash, 1, str(tmp_path), point)
    step, value, notes = restored(tmp_path)
    committed = point == "pointer_updated"
    assert (step, value) == ((2, 2.0) if committed else (1, 1.0))
    if point in ("temp_written", "temp_synced"):
        assert any("partial file" in note and ".step_00000002.pt.tmp" in note for note in notes)
    if point in ("renamed", "pointer_written"):
        assert any("interrupted before latest named it" in note for note in notes)
    # The next save cleans up what the crash left behind.
    Checkpointer(tmp_path, keep=1).save(3, model=model_with(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003.pt"]
    assert restored(tmp_path) == (3, 3.0, [])


def three_checkpoints(directory: Path) -> Path:
    checkpointer = Checkpointer(directory)
    for step in (1, 2, 3):
        checkpointer.save(step, model=model_with(float(step)))
    return checkpointer.files.path_for(3)


def test_a_corrupt_or_truncated_latest_is_skipped_with_a_warning(tmp_path):
    latest = three_checkpoints(tmp_path / "flip")
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.write_bytes(bytes(data))
    step, value, notes = restored(tmp_path / "flip")
    assert (step, value) == (2, 2.0)
    assert any(str(latest) in n and "CRC32" in n for n in notes)

    latest = three_checkpoints(tmp_path / "cut")
    os.truncate(latest, latest.stat().st_size - 100)
    step, value, notes = restored(tmp_path / "cut")
    assert (step, value) == (2, 2.0)
    assert any(str(latest) in n and "truncated" in n for n in notes)


def test_a_missing_or_unreadable_pointer_falls_back_to_the_newest_file(tmp_path):
    three_checkpoints(tmp_path)
    (tmp_path / "latest").write_text("garbage\n")
    step, _, notes = restored(tmp_path)
    assert step == 3 and any("latest is unreadable" in n for n in notes)
    (tmp_path / "latest").unlink()
    assert restored(tmp_path) == (3, 3.0, [])


class RunsCode:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_checkpoint_holding_a_pickled_object_is_refused_and_never_runs(tmp_path):
    three_checkpoints(tmp_path)
    marker = tmp_path / "code-ran"
    payload = {FORMAT_KEY: FORMAT_VERSION, "step": 4, "model": {}, "extra": RunsCode(str(marker))}
    torch.save(payload, tmp_path / "step_00000004.pt")
    (tmp_path / "latest").write_text("step_00000004.pt\n")
    step, value, notes = restored(tmp_path)
    assert (step, value) == (3, 3.0)
    assert any("step_00000004.pt was refused" in n and "weights_only" in n for n in notes)
    for step in (1, 2, 3):
        Checkpointer(tmp_path).files.path_for(step).unlink()
    with pytest.raises(
        CheckpointError, match=r"no valid checkpoint .*step_00000004.pt was refused"
    ):
        Checkpointer(tmp_path).restore(model=model_with(0.0))
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # the oracle: torch refuses it too
        torch.load(tmp_path / "step_00000004.pt", weights_only=True)


def test_only_partial_files_start_fresh_or_fail_naming_the_file(tmp_path):
    (tmp_path / "tmp-only").mkdir()
    (tmp_path / "tmp-only" / ".step_00000005.pt.tmp").write_bytes(b"PK\x03\x04 half")
    step, _, notes = restored(tmp_path / "tmp-only")
    assert step is None and any(
        ".step_00000005.pt.tmp left by an interrupted save" in n for n in notes
    )

    latest = Checkpointer(tmp_path / "cut").save(1, model=model_with(1.0))
    os.truncate(latest, 200)
    with pytest.raises(CheckpointError, match=r"step_00000001.pt is truncated") as info:
        Checkpointer(tmp_path / "cut").restore(model=model_with(0.0))
    assert "remove these files" in str(info.value)
    assert restored(tmp_path / "empty") == (None, None, [])


def test_a_failed_write_keeps_the_previous_checkpoint_and_names_the_directory(tmp_path):
    three_checkpoints(tmp_path)

    def disk_full(point: str) -> None:
        if point == "temp_written":
            raise OSError(28, "No space left on device")

    checkpointer = Checkpointer(tmp_path)
    checkpointer.files.on_point = disk_full
    with pytest.raises(
        CheckpointError, match=f"step_00000004.pt in {tmp_path} failed: No space left"
    ):
        checkpointer.save(4, model=model_with(4.0))
    assert restored(tmp_path)[:2] == (3, 3.0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="Expected a writable directory"):
        Checkpointer(blocker / "ckpt").save(1, model=model_with(1.0))


def test_a_checkpoint_of_another_model_is_refused_and_leaves_the_model_alone(tmp_path):
    Checkpointer(tmp_path).save(1, model=model_with(1.0))
    other = nn.Sequential(nn.Linear(3, 2))
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path).restore(model=other)
    message = str(info.value)
    assert "step_00000001.pt does not fit this model" in message
    assert "keys missing from the checkpoint [0.weight, 0.bias]" in message
    assert "keys the model does not have [weight, bias]" in message
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    with pytest.raises(
        CheckpointError, match=r"shape mismatches \[weight: checkpoint \(2, 3\) vs model \(4, 3\)"
    ):
        Checkpointer(tmp_path).restore(model=nn.Linear(3, 4))
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        model = model_with(0.0)
        Checkpointer(tmp_path).restore(model=model, optimizer=torch.optim.SGD(model.parameters()))


def test_only_the_newest_keep_checkpoints_stay_and_extra_comes_back(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in range(5):
        checkpointer.save(step, model=model_with(1.0), extra={"loss": torch.tensor(0.5), "n": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000003.pt",
        "step_00000004.pt",
    ]
    assert checkpointer.restore(model=model_with(0.0)) == 4
    assert checkpointer.extra["n"] == 4 and torch.equal(
        checkpointer.extra["loss"], torch.tensor(0.5)
    )
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint\['extra'\]\['fn'\] is a builtins.builtin_function_or_method",
    ):
        checkpointer.save(5, model=model_with(1.0), extra={"fn": len})
    with pytest.raises(CheckpointError, match="expected a step that is an int >= 0"):
        checkpointer.save(-1, model=model_with(1.0))


def test_random_states_survive_a_weights_only_round_trip(tmp_path):
    state = rng.capture()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(2), random.gauss(0, 1))
    random.random(), np.random.rand(), torch.rand(5)  # move every generator on
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(2), random.gauss(0, 1))
    assert got[0] == expected[0] and got[1] == expected[1] and got[3] == expected[3]
    assert torch.equal(got[2], expected[2])


def test_a_checkpoint_folder_deleted_during_the_run_is_named_when_made_again(tmp_path):
    directory = tmp_path / "ckpt"
    checkpointer = Checkpointer(directory)
    checkpointer.save(1, model=model_with(1.0))
    shutil.rmtree(directory)  # by hand, by a cleanup job, by a quota script
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer.save(2, model=model_with(2.0))
    said = [str(w.message) for w in caught]
    assert any(f"{directory} was deleted during the run" in m and "step 1" in m for m in said)
    assert restored(directory)[:2] == (2, 2.0)
