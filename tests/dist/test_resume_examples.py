"""The DDP lab's two examples, end to end: one process each, as a user runs them.

train_single.py runs 2 epochs, then again to 3 (a resume from its checkpoint);
train_ddp.py under plain `python` (world size 1) runs 3 epochs straight. The two
scripts differ only by the data-parallel lines, so every printed line and the
final checkpoints (model and optimizer) must be bitwise equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str, *args: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_single_resumed_and_ddp_at_world_size_one_are_bitwise_equal(tmp_path):
    single, ddp = str(tmp_path / "single"), str(tmp_path / "ddp")
    first = run_example("train_single.py", "--epochs", "2", "--ckpt-dir", single)
    second = run_example("train_single.py", "--epochs", "3", "--ckpt-dir", single)
    straight = run_example("train_ddp.py", "--epochs", "3", "--ckpt-dir", ddp)
    assert second[0] == f"resumed after epoch 2 from {single}"
    assert first[:-1] + second[1:] == straight
    assert straight[-1].startswith("test accuracy ")
    assert float(straight[-1].split()[-1]) > 0.9
    a = torch.load(Path(single) / "step_00000003.pt", weights_only=True)
    b = torch.load(Path(ddp) / "step_00000003.pt", weights_only=True)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(
            state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"]
        )
    assert a["sampler"] == b["sampler"]
