"""`lockstep run --live-recovery` without spares: a child of the node's fork server takes the rank.

Real launchers, workers and kills (`train_live.py` kills itself at a chosen point and
writes each process's pid and its parent's pid). The launcher logs the fork server's
pid when it starts it and the child's pid when it forks one. So the proof that the
fork server took the rank is that the replacement's parent is the fork server; the
proof of the fallback is a replacement whose parent is the launcher, with the line
that names the fork server's end; a child that was a worker dies with its server and
is replaced by a new process. The oracle is the same script without kills:
final parameters and Adam state bitwise equal. Neither the fork server nor its child
may outlive the run or a SIGKILLed launcher.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from launchkit import Launcher
from test_live_recovery import SCRIPT, _assert_bitwise, _run
from test_live_spares import _assert_gone, _pid

from lockstep.launch.cli.parser import add_parser, run_config
from lockstep.launch.recovery.forkserver import blas_threads, fork_unsafe

SERVER = re.compile(r"fork server pid (\d+) started")
WAIT_S = 150


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run every killed run here is compared with."""
    out = tmp_path_factory.mktemp("forkserver") / "uninterrupted"
    _run(out, [])
    return out


def _parent(out: Path, process: str) -> int:
    return int((out / "parents" / process).read_text())


def _wait_for(launcher: Launcher, pattern: re.Pattern | str) -> re.Match:
    """The first match of `pattern` in the launcher's log; fails with the log after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = re.search(pattern, launcher.log())
        if found:
            return found
        assert launcher.proc.poll() is None, f"{pattern} never came:\n{launcher.log()}"
        time.sleep(0.1)
    launcher.kill()
    raise AssertionError(f"no {pattern} within {WAIT_S} s:\n{launcher.log()}")


def _server(log: str) -> int:
    servers = [int(pid) for pid in SERVER.findall(log)]
    assert len(servers) == 1, f"expected one fork server started; found {servers}:\n{log}"
    return servers[0]


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_child_of_the_fork_server_takes_the_lost_rank(tmp_path, oracle):
    """Rank 1 lost inside backward, no spares: the fork server's child is its replacement."""
    out = tmp_path / "forked"
    launcher = _run(out, ["--live-recovery"], "1:3:backward", ("--step-sleep", "0.5"))
    log = launcher.log()
    server, replacement = _server(log), _pid(out, "1.1.0")
    assert f"fork server pid {server} forked pid {replacement} for local rank 1" in log, log
    assert _parent(out, "1.1.0") == server, log  # forked by the server, not started anew
    assert _parent(out, "0.0.0") == launcher.proc.pid, log  # the survivor: torch's agent's
    assert "restart 1" not in log and "not possible" not in log, log
    _assert_bitwise(out, oracle)
    assert f"fork server pid {server} ended with the run" in log, log
    _assert_gone([server, replacement, _pid(out, "0.0.0")], log)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_fork_server_leaves_the_rank_to_a_new_process(tmp_path, oracle):
    """The fork server SIGKILLed before the loss: a new process takes the rank, one line
    says why, and the recovery is live and bitwise as without a fork server."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", "2", "--live-recovery", SCRIPT, "--out", str(tmp_path)]
    argv += ["--steps", "6", "--step-sleep", "1.0"]
    env = {"LOCKSTEP_TEST_KILL": "1:4:backward", "LOCKSTEP_STALL_WARN_S": "60"}
    launcher = Launcher(argv, tmp_path / "launcher.log", env=env)
    server = int(_wait_for(launcher, SERVER).group(1))
    os.kill(server, signal.SIGKILL)
    assert launcher.wait(WAIT_S) == 0, launcher.log()
    log = launcher.log()
    assert not (tmp_path / "pids" / "1.0.1").exists(), log  # nothing restarted
    line = f"local rank 1: the fork server (pid {server}) has ended (killed by SIGKILL"
    assert line in log and "a new process takes it" in log, log
    assert _parent(tmp_path, "1.1.0") == launcher.proc.pid, log  # started anew
    assert "forked pid" not in log and "restart 1" not in log, log
    _assert_bitwise(tmp_path, oracle)
    _assert_gone([server, _pid(tmp_path, "1.1.0")], log)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_forked_by_a_server_that_dies_dies_with_it_and_is_replaced(tmp_path, oracle):
    """The fork server SIGKILLed while its child is rank 1: the child dies with it (the
    parent-death signal), and a new process replaces it live, bitwise."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", "2", "--live-recovery", SCRIPT, "--out", str(tmp_path)]
    argv += ["--steps", "6", "--step-sleep", "1.0"]
    env = {"LOCKSTEP_TEST_KILL": "1:1:backward", "LOCKSTEP_STALL_WARN_S": "60"}
    launcher = Launcher(argv, tmp_path / "launcher.log", env=env)
    forked = _wait_for(launcher, r"fork server pid (\d+) forked pid (\d+) for local rank 1")
    server, child = int(forked.group(1)), int(forked.group(2))
    _wait_for(launcher, r"generation 1 formed")
    os.kill(server, signal.SIGKILL)
    assert launcher.wait(WAIT_S) == 0, launcher.log()
    log = launcher.log()
    assert f"rank 1 (pid {child}) killed by SIGKILL" in log, log
    assert f"local rank 1: the fork server (pid {server}) has ended" in log, log
    assert _parent(tmp_path, "1.2.0") == launcher.proc.pid, log  # generation 2: started anew
    assert "restart 1" not in log and "not possible" not in log, log
    _assert_bitwise(tmp_path, oracle)
    _assert_gone([server, child, _pid(tmp_path, "1.2.0")], log)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fork_server_and_its_child_die_with_a_killed_launcher(tmp_path):
    """SIGKILL the launcher after the fork server's child took a rank: none is left."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", "2", "--live-recovery", SCRIPT, "--out", str(tmp_path)]
    argv += ["--steps", "100", "--step-sleep", "0.2"]
    env = {"LOCKSTEP_TEST_KILL": "1:1:backward", "LOCKSTEP_STALL_WARN_S": "60"}
    launcher = Launcher(argv, tmp_path / "launcher.log", env=env)
    child = int(_wait_for(launcher, r"fork server pid \d+ forked pid (\d+)").group(1))
    _wait_for(launcher, r"generation 1 formed")
    launcher.kill()
    log = launcher.log()
    server = _server(log)
    _assert_gone([server, child, _pid(tmp_path, "0.0.0")], log)


def test_the_fork_server_is_on_unless_turned_off():
    """--live-recovery has a fork server; --no-fork-server turns it off."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert run_config(parser.parse_args(["run", "--live-recovery", SCRIPT])).fork_server
    flags = ["run", "--live-recovery", "--no-fork-server", SCRIPT]
    assert not run_config(parser.parse_args(flags)).fork_server


def test_a_process_running_a_second_thread_may_not_fork():
    """The server's check before each fork names the threads it found."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="second")
    thread.start()
    try:
        reason = fork_unsafe()
    finally:
        stop.set()
        thread.join(timeout=10)
    assert reason is not None and "where a fork needs 1" in reason, reason


def test_the_child_gets_the_blas_threads_a_new_worker_would_take():
    """OpenBLAS's order: OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS, OMP_NUM_THREADS, cores."""
    cores = len(os.sched_getaffinity(0))
    assert blas_threads({}) == cores
    assert blas_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert blas_threads({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "2"}) == min(2, cores)
    assert blas_threads({"GOTO_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}) == 1
    assert blas_threads({"OMP_NUM_THREADS": "x"}) == cores
