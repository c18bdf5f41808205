"""`lockstep run --live-recovery --spares K`: a standby process takes the lost rank.

Real launchers, workers and kills (`train_live.py` kills itself at a chosen point).
The launcher logs each spare's pid when it starts it; the script writes each rank's
pid per process. So the proof that a spare took the rank is that the replacement's
pid is a spare's, and the proof of the refill is that the second replacement's pid
is that of a spare started after the first recovery. The oracle is the same script
without kills: final parameters and Adam state bitwise equal. No spare may outlive
its launcher, whether the run ends or the launcher is SIGKILLed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from pathlib import Path

import pytest
from launchkit import Launcher
from test_live_recovery import SCRIPT, _assert_bitwise, _run

from lockstep.launch.cli.parser import add_parser, run_config

STARTED = re.compile(r"spare pid (\d+) started")
GONE_S = 15.0


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie has ended: its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _assert_gone(pids: list[int], log: str) -> None:
    deadline = time.monotonic() + GONE_S
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # do not leak it into the next tests
    assert not left, f"processes {left} outlived their launcher:\n{log}"


def _pid(out: Path, process: str) -> int:
    return int((out / "pids" / process).read_text())


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spares_take_the_lost_ranks_and_the_pool_is_refilled(tmp_path):
    """Rank 1 lost in its optimizer step, then rank 0 in forward: spares take both ranks."""
    oracle = tmp_path / "uninterrupted"
    _run(oracle, [])
    out = tmp_path / "spares"
    flags = ["--live-recovery", "--spares", "1"]
    launcher = _run(out, flags, "1:1:optimizer,0:4:forward", ("--step-sleep", "0.7"))
    log = launcher.log()
    spares = [int(pid) for pid in STARTED.findall(log)]
    # the replacements are the first two spares, in order: the pool was refilled
    # (one spare starts with the job, a new one after each recovery)
    assert [_pid(out, "1.1.0"), _pid(out, "0.2.0")] == spares[:2], log
    assert f"spare pid {spares[0]} takes local rank 1" in log, log
    assert f"spare pid {spares[1]} takes local rank 0" in log, log
    assert "restart 1" not in log, log
    # the third, idle at the end, is ended by the launcher itself (else by the kernel)
    assert len(spares) == 3 and f"spare pid {spares[2]} ended with the run" in log, log
    _assert_bitwise(out, oracle)
    _assert_gone(spares, log)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spares_die_with_a_killed_launcher(tmp_path):
    """SIGKILL the launcher mid-run: its idle spare ends with it, like its workers."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", "2", "--live-recovery", "--spares", "1", SCRIPT]
    argv += ["--out", str(tmp_path), "--steps", "100", "--step-sleep", "0.2"]
    launcher = Launcher(argv, tmp_path / "launcher.log")
    deadline = time.monotonic() + 120
    while "finished step 1" not in launcher.log() and time.monotonic() < deadline:
        assert launcher.proc.poll() is None, launcher.log()
        time.sleep(0.2)
    launcher.kill()
    log = launcher.log()
    spares = [int(pid) for pid in STARTED.findall(log)]
    workers = [_pid(tmp_path, f"{rank}.0.0") for rank in (0, 1)]
    assert len(spares) == 1, log
    _assert_gone(spares + workers, log)


def test_spares_need_live_recovery():
    """--spares without --live-recovery is a one-line error; the count is checked."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(ValueError, match="--spares 1 needs --live-recovery"):
        run_config(parser.parse_args(["run", "--spares", "1", SCRIPT]))
    with pytest.raises(ValueError, match="--spares must be at least 0; found -1"):
        run_config(parser.parse_args(["run", "--live-recovery", "--spares", "-1", SCRIPT]))
    flags = ["run", "--live-recovery", "--spares", "2", SCRIPT]
    assert run_config(parser.parse_args(flags)).spares == 2
