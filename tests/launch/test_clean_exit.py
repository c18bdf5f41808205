"""A script that never calls lockstep.shutdown() exits 0 under torchrun, run after run.

tests/launch/train_no_shutdown.py uses the communication thread (ring all-reduce),
the PowerSGD pool, the step fingerprint and the stall inspector, then ends without
shutdown(). Each run must exit 0 with no "terminate called" abort in its output.
make soak runs LOCKSTEP_CLEAN_EXIT_RUNS (default 2) runs; the 20-run figure in
docs/multinode.md comes from

    LOCKSTEP_CLEAN_EXIT_RUNS=20 python -m pytest -q tests/launch/test_clean_exit.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).with_name("train_no_shutdown.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RUNS = int(os.environ.get("LOCKSTEP_CLEAN_EXIT_RUNS", "2"))


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(180 * RUNS)
def test_a_script_without_shutdown_exits_cleanly_under_torchrun():
    bad = []
    for run in range(RUNS):
        done = subprocess.run(
            [TORCHRUN, "--nproc-per-node", "2", SCRIPT],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        output = done.stdout + done.stderr
        if done.returncode != 0 or "terminate called" in output:
            bad.append(f"run {run}: exit code {done.returncode}\n{output[-3000:]}")
    assert not bad, f"{len(bad)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(bad)
