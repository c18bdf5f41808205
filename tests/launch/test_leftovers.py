"""Nothing left behind, nothing slow to report: temp folders, a foreign port, a rank given twice.

Every launcher here runs with TMPDIR set to the test's own folder, so what torch
or lockstep leave in the temp folder is visible and no other job's folders count.
The foreign program and the duplicated --node-rank must be reported within 10 s
of the launcher being up (its first log line), whatever the rendezvous timeout.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchkit import TRAIN, Launcher, first_line_to_exit, wait_all, wait_for

pytestmark = pytest.mark.slow  # whole launcher runs, several seconds each

REPORT_S = 10.0


def _tmp(tmp_path: Path) -> dict[str, str]:
    folder = tmp_path / "tmp"
    folder.mkdir(exist_ok=True)
    return {"TMPDIR": str(folder)}


def _leftovers(tmp_path: Path) -> list[str]:
    """What runs left in the temp folder, but torch's compile cache (one per user, reused)."""
    names = (path.name for path in (tmp_path / "tmp").iterdir())
    return sorted(name for name in names if not name.startswith("torchinductor_"))


def _single(tmp_path: Path, name: str, *script: str) -> Launcher:
    out = tmp_path / name
    argv = ["--nproc-per-node", "1", TRAIN, "--out", str(out), *script]
    return Launcher(argv, tmp_path / f"{name}.log", env=_tmp(tmp_path))


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_temp_folder_survives_a_run_a_failure_or_a_signal(tmp_path):
    ok = _single(tmp_path, "ok", "--steps", "2")
    failed = _single(tmp_path, "failed", "--raise-rank", "0")
    assert wait_all([ok, failed], 120) == [0, 1], ok.log() + failed.log()
    assert _leftovers(tmp_path) == []
    for sig in (signal.SIGTERM, signal.SIGINT):
        stopped = _single(tmp_path, sig.name, "--steps", "100000", "--step-sleep", "0.05")
        wait_for(tmp_path / sig.name / "pids" / "0.0", 120, [stopped])
        stopped.proc.send_signal(sig)
        assert stopped.wait(timeout=60) == 128 + sig, stopped.log()
        assert _leftovers(tmp_path) == [], sig.name


@pytest.mark.soak
def test_a_sigkilled_launchers_folder_is_removed_by_the_next_run(tmp_path):
    killed = _single(tmp_path, "killed", "--steps", "100000", "--step-sleep", "0.05")
    wait_for(tmp_path / "killed" / "pids" / "0.0", 120, [killed])
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(timeout=30)
    left = _leftovers(tmp_path)
    assert left and all(name.startswith(f"lockstep-run-{killed.proc.pid}-") for name in left)
    after = _single(tmp_path, "after", "--steps", "1")
    assert after.wait(timeout=120) == 0, after.log()
    assert _leftovers(tmp_path) == []


def test_a_watchdog_exit_removes_the_folder(tmp_path):
    folder = tmp_path / "scratch"
    folder.mkdir()
    code = (
        "import sys, time\n"
        "from lockstep.launch.supervise import scratch\n"
        "from lockstep.launch.watches.watchdog import Watchdog\n"
        "dog = Watchdog('x:1', step_s=0.2, margin_s=0.1, "
        "on_exit=lambda: scratch.remove(__import__('pathlib').Path(sys.argv[1])))\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(folder)], timeout=60, check=False)
    assert done.returncode == 1
    assert not folder.exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _node(rank: int, port: int, tmp_path: Path, name: str) -> Launcher:
    argv = ["--nnodes", "2", "--node-rank", str(rank), "--master-port", str(port)]
    argv += ["--nproc-per-node", "1", TRAIN, "--out", str(tmp_path / "out")]
    argv += ["--steps", "100000", "--step-sleep", "0.05"]  # still running when told to stop
    return Launcher(argv, tmp_path / f"{name}.log", env=_tmp(tmp_path))


def test_a_foreign_program_on_the_master_port_is_reported_within_10_s(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as foreign:  # accepts, never answers
        port = int(foreign.getsockname()[1])
        node1 = _node(1, port, tmp_path, "node1")
        took = first_line_to_exit([node1], 60)
    log = node1.log()
    print(f"foreign program reported {took:.1f} s after the launcher's first line")
    assert took < REPORT_S, f"{took:.1f} s\n{log}"
    assert node1.proc.returncode == 1
    assert f"the rendezvous store at 127.0.0.1:{port} does not answer" in log
    assert "another program" in log


@pytest.mark.soak
def test_a_node_rank_given_twice_is_reported_within_10_s(tmp_path):
    port = _free_port()
    launchers = [_node(0, port, tmp_path, "node0")]
    time.sleep(1.0)  # node 0 first, as a scheduler would start it; then two "node 1"
    launchers += [_node(1, port, tmp_path, f"node1{tag}") for tag in "ab"]
    took = first_line_to_exit(launchers, 60)
    logs = [launcher.log() for launcher in launchers]
    print(f"duplicated node rank reported {took:.1f} s after the last launcher's first line")
    assert took < REPORT_S, f"{took:.1f} s\n" + "\n".join(logs)
    assert [launcher.proc.returncode for launcher in launchers] == [1, 1, 1], logs
    for log in logs:
        assert "two nodes were started with --node-rank 1" in log, log
    assert _leftovers(tmp_path) == []
