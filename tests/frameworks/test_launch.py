"""Examples under real launchers: `lockstep run --engine lockstep`, `torchrun -m lockstep.adopt`.

Each test starts a launcher with 2 workers on an example script that does not
name lockstep's engine, and checks from the output that lockstep's engine ran
(the wrapper's class), that the framework printed its result once (rank 0 only),
and, with --trace, that LOCKSTEP_TRACE wrote every rank's steps under the framework.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # frameworks' imports and ranks: make test, not the inner loop

EXAMPLES = Path(__file__).parents[2] / "examples"
TIMEOUT_S = 240


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_accelerate_script_under_lockstep_run_with_engine_and_trace(tmp_path):
    argv = ["-m", "lockstep.cli", "run", "--nproc-per-node", "2", "--engine", "lockstep"]
    argv += ["--trace", str(tmp_path / "trace"), str(EXAMPLES / "accelerate_loop.py")]
    out = _run(argv, tmp_path)
    assert out.count("wrapper TorchFacedDDP") == 1, out
    for rank in (0, 1):
        events = json.loads((tmp_path / "trace" / f"trace_rank{rank}.json").read_text())
        steps = [e for e in events["traceEvents"] if e.get("name", "").startswith("step")]
        assert steps, f"rank {rank}: no step in its trace"
    assert (tmp_path / "trace" / "trace.json").is_file(), out  # the launcher merged them


@pytest.mark.soak
@pytest.mark.slow
def test_plain_lightning_script_under_torchrun_adopted(tmp_path):
    argv = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "lockstep.adopt"]
    argv += [str(EXAMPLES / "lightning_module.py"), "--strategy", "ddp"]
    out = _run(argv, tmp_path)
    assert out.count("wrapper TorchFacedDDP") == 1, out
