"""The stall watch under `lockstep run`: a hung rank is named first, with its stack, quickly.

Real launchers and real workers (tests/launch/train_stall.py): rank 1 sleeps forever
at step 3, or runs out of data and calls Checkpointer.save while rank 0 still
trains. The run must end within the stall timeout plus 15 s, blaming rank 1 with
its Python stack, naming rank 0 as waiting on a gradient bucket; rank 0's own log
must say which rank has not launched the bucket it waits on.
"""

from __future__ import annotations

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


def test_a_rank_out_of_data_that_saves_a_checkpoint_is_named_first(tmp_path):
    log, took = _run_stalled(tmp_path, "--short-rank", "1")
    assert "rank 1 (node 0" in _first_failure(log), log
    assert "inside Checkpointer.save(step=5)" in log
    assert "in save" in log  # rank 1's stack is inside Checkpointer.save
    assert "rank 0 waiting on gradient bucket 0 of step 6" in log
    assert took <= STALL_S + 15, f"the run ended {took:.1f} s after rank 1 left the loop:\n{log}"
