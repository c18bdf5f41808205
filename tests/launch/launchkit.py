"""Helpers for the launcher tests: start `lockstep run` as a real process, wait, read its log.

Every process started here has a deadline and is killed when it passes it, so a
test fails with the launcher's log instead of hanging. Workers die with their
launcher (lockstep's bootstrap asks the kernel for that), so killing a launcher
is enough to clean up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lockstep.testing.netns import Host

TRAIN = str(Path(__file__).with_name("train_tiny.py"))
MASTER_PORT = 29555  # inside our own namespaces, so no other job can hold it
JOB_SECRET = "lockstep-tests-job-secret-6d1f0c"  # what a scheduler would export on every node


class Launcher:
    """One `lockstep run` process whose stdout and stderr go to a file."""

    def __init__(
        self,
        argv: Sequence[str],
        log: Path,
        host: Host | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = log
        with open(log, "w") as sink:
            argv = [sys.executable, "-m", "lockstep.cli", "run", *argv]
            kwargs = {
                "stdout": sink,
                "stderr": subprocess.STDOUT,
                "env": {**os.environ, "LOCKSTEP_JOB_SECRET": JOB_SECRET, **(env or {})},
            }
            self.proc = host.popen(argv, **kwargs) if host else subprocess.Popen(argv, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit code; on timeout kill the launcher and fail with its log."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            message = f"lockstep run still running after {timeout} s:\n{self.log()}"
            raise AssertionError(message) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def node_args(a: Host, node_rank: int, *, nproc: int = 2, extra: Sequence[str] = ()) -> list[str]:
    """Flags for node `node_rank` of a two-node job whose master is host `a`."""
    return [
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        a.address,
        "--master-port",
        str(MASTER_PORT),
        "--nproc-per-node",
        str(nproc),
        *extra,
    ]


def two_nodes(a: Host, b: Host, out: Path, flags: Sequence[str], script: Sequence[str]):
    """Start node 0 in `a` and node 1 in `b`; logs go to out/node0.log and out/node1.log."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        Launcher([*node_args(a, rank, extra=flags), TRAIN, *script], out / f"node{rank}.log", h)
        for rank, h in enumerate((a, b))
    ]


def wait_all(launchers: Sequence[Launcher], timeout: float) -> list[int]:
    """Exit codes of all launchers; kills all of them if any passes the deadline."""
    deadline = time.monotonic() + timeout
    try:
        return [launcher.wait(max(1.0, deadline - time.monotonic())) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()


def wait_for(path: Path, timeout: float, launchers: Sequence[Launcher] = ()) -> None:
    """Block until `path` exists; fail (with the logs) after `timeout` or if a launcher exits."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        ended = [launcher for launcher in launchers if launcher.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(launcher.log() for launcher in launchers)
            raise AssertionError(f"{path} did not appear within {timeout} s:\n{logs}")
        time.sleep(0.1)


def final_params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def live_workers(out: Path) -> list[int]:
    """Pids recorded by train_tiny.py workers that still exist (zombies count as gone)."""
    alive = []
    for pid_file in (out / "pids").glob("*"):
        pid = int(pid_file.read_text())
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z" and b"train_tiny" in cmdline:
            alive.append(pid)
    return alive


def first_line_to_exit(launchers: list[Launcher], timeout: float) -> float:
    """Seconds from the last launcher's first log line to the last exit (killed at `timeout`)."""
    deadline = time.monotonic() + timeout
    up: dict[int, float] = {}
    while time.monotonic() < deadline:
        for index, launcher in enumerate(launchers):
            if index not in up and "lockstep run [node" in launcher.log():
                up[index] = time.monotonic()
        if all(launcher.proc.poll() is not None for launcher in launchers):
            return time.monotonic() - max(up.values(), default=deadline)
        time.sleep(0.05)
    wait_all(launchers, 0.1)
    return float("inf")


def first_line_to_text(launchers: list[Launcher], texts: list[str], timeout: float) -> float:
    """Seconds from the last launcher's first log line until launcher i logs `texts[i]`
    (every launcher), or inf after `timeout`; the launchers are left running."""
    deadline = time.monotonic() + timeout
    up: dict[int, float] = {}
    while time.monotonic() < deadline:
        logs = [launcher.log() for launcher in launchers]
        for index, log in enumerate(logs):
            if index not in up and "lockstep run [node" in log:
                up[index] = time.monotonic()
        if all(text in log for text, log in zip(texts, logs, strict=True)):
            return time.monotonic() - max(up.values())
        time.sleep(0.05)
    return float("inf")
