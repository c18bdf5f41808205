"""The stall watch: a hung rank is named first, with its stack (or as frozen), quickly.

Real launchers and real workers (tests/launch/train_stall.py): rank 1 sleeps forever
at step 3, or runs out of data and calls Checkpointer.save while rank 0 still
trains. The run must end within the stall timeout plus 15 s, blaming rank 1 with
its Python stack, naming rank 0 as waiting on a gradient bucket; rank 0's own log
must say which rank has not launched the bucket it waits on. A save that finished
is not blamed for a later stall (phases end); a rank stopped by SIGSTOP is named
frozen and ended within lockstep's shutdown bound; under torchrun, with
LOCKSTEP_STALL_TIMEOUT_S set, the waiting rank ends the run naming rank 1, which
torchrun's own "Root Cause" header names too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchkit import Launcher

pytestmark = pytest.mark.slow  # two stalls of STALL_S each, under the real launcher
SCRIPT = str(Path(__file__).with_name("train_stall.py"))
STALL_S = 5
ENV = {"LOCKSTEP_STALL_WARN_S": "2"}


def _run_stalled(tmp_path: Path, *script_args: str) -> tuple[str, float]:
    out = tmp_path / "out"
    flags = ["--nproc-per-node", "2", "--stall-timeout", str(STALL_S)]
    launcher = Launcher(
        [*flags, SCRIPT, "--out", str(out), *script_args], tmp_path / "log", env=ENV
    )
    code = launcher.wait(timeout=180)
    ended = time.time()
    log = launcher.log()
    assert code == 1, log
    started = float((out / "hang_started").read_text())
    return log, ended - started


def _first_failure(log: str) -> str:
    return next(line for line in log.splitlines() if "first failure:" in line)


def test_a_rank_that_sleeps_forever_is_named_first_with_its_stack(tmp_path):
    log, took = _run_stalled(tmp_path, "--hang-rank", "1", "--hang-step", "3")
    assert "rank 1 (node 0" in _first_failure(log), log
    assert "stalled: no progress" in _first_failure(log)
    assert "in hang_here" in log  # rank 1's own stack, from faulthandler
    assert "rank 0 waiting on gradient bucket 0 of step 4" in log
    assert "[rank 0]: waited" in log and "rank(s) 1 have not launched it" in log
    assert "What to do" in log
    assert took <= STALL_S + 15, f"the run ended {took:.1f} s after rank 1 hung:\n{log}"


@pytest.mark.soak
def test_a_rank_out_of_data_that_saves_a_checkpoint_is_named_first(tmp_path):
    log, took = _run_stalled(tmp_path, "--short-rank", "1")
    assert "rank 1 (node 0" in _first_failure(log), log
    assert "inside Checkpointer.save(step=5)" in log
    assert "in save" in log  # rank 1's stack is inside Checkpointer.save
    assert "left the training loop early (it ran out of data)" in log, log
    assert "rank 0 waiting on gradient bucket 0 of step 6" in log
    assert took <= STALL_S + 15, f"the run ended {took:.1f} s after rank 1 left the loop:\n{log}"


@pytest.mark.soak
@pytest.mark.slow
def test_a_save_that_finished_is_not_blamed_for_a_later_stall(tmp_path):
    log, _ = _run_stalled(tmp_path, "--save-step", "2", "--hang-rank", "1", "--hang-step", "3")
    assert "rank 1 (node 0" in _first_failure(log), log
    where = "after step 3 (synchronised), before step 4's backward"
    assert f"rank 1 stopped making progress ({where})" in log, log
    assert "inside Checkpointer.save" not in log, log
    assert "ran out of data" not in log, log  # the advice fits where rank 1 is


@pytest.mark.soak
@pytest.mark.slow
def test_a_frozen_rank_is_named_frozen_and_ended_within_lockstep_s_bound(tmp_path):
    log, took = _run_stalled(tmp_path, "--hang-rank", "1", "--hang-step", "3", "--freeze")
    assert "rank 1 (node 0" in _first_failure(log), log
    assert "rank 1 is frozen (after step 3 (synchronised)" in log, log
    assert "says state T (stopped)" in log and "kill -CONT" in log, log
    assert "was it started by lockstep's bootstrap" not in log, log
    # stall timeout, then SIGTERM and the 10 s shutdown bound (not torch's 30 s) before SIGKILL
    assert took <= STALL_S + 20, f"the run ended {took:.1f} s after rank 1 froze:\n{log}"


@pytest.mark.soak
@pytest.mark.slow
def test_under_torchrun_the_stall_bound_ends_the_run_naming_the_stuck_rank(tmp_path):
    # A sleeping rank, not a frozen one: torchrun would wait its own 30 s to kill a frozen one.
    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv = [*torchrun, "--nproc-per-node", "2", SCRIPT, "--out", str(out)]
    argv += ["--hang-rank", "1", "--hang-step", "3"]
    bounds = {"LOCKSTEP_STALL_WARN_S": "1", "LOCKSTEP_STALL_TIMEOUT_S": "4"}
    env = {**os.environ, **bounds, "OMP_NUM_THREADS": "1"}
    # Without the bound rank 0 would wait for the collective timeout (5 min): killed at 100 s.
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=100, check=False)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    assert "[rank 0]: waited" in log and "rank(s) 1 have not launched it" in log, log
    # torchrun's "Root Cause" is the failure with the earliest time: rank 0, which only
    # waited, wrote rank 1's error file (same node) with the time its wait began
    root_cause = log[log.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root_cause, log
    assert "lockstep: rank 1 is stuck: it never launched " in root_cause, log
    assert "(not waiting in any lockstep collective)" in root_cause, log
    failures = log[log.index("Failures:") : log.index("Root Cause")]
    assert "stuck: rank(s) 1 have not launched it" in failures, log
    assert "(rank 1: not waiting in any lockstep collective)" in failures, log
    assert "rank 0 only waited for them" in failures, log
