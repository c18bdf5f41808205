"""The DDP lab's two examples, end to end: one process each, as a user runs them.

train_single.py trains 3 epochs, checkpointing after each. train_ddp.py, under
plain `python` (world size 1), is then started on a copy of the epoch-2
checkpoint: it must resume from it (a plain model's checkpoint into a wrapped
model) and train epoch 3 exactly as train_single.py did, since the scripts differ
only by the data-parallel lines: same printed lines, bitwise equal checkpoints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.soak
@pytest.mark.slow
def test_ddp_at_world_size_one_resumes_single_and_matches_it_bitwise(tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    lines = run_example("train_single.py", "--epochs", "3", "--ckpt-dir", str(single))
    assert [line.split(":")[0] for line in lines[:3]] == ["epoch 1", "epoch 2", "epoch 3"]
    assert float(lines[-1].removeprefix("test accuracy ")) > 0.9
    ddp.mkdir()
    shutil.copy(single / "step_00000002.pt", ddp)
    (ddp / "latest").write_text("step_00000002.pt\n")
    resumed = run_example("train_ddp.py", "--epochs", "3", "--ckpt-dir", str(ddp))
    assert resumed == [f"resumed after epoch 2 from {ddp}", *lines[2:]]
    a = torch.load(single / "step_00000003.pt", weights_only=True)
    b = torch.load(ddp / "step_00000003.pt", weights_only=True)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(
            state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"]
        )
    assert a["sampler"] == b["sampler"] and a["sampler"]["epoch"] == 2
