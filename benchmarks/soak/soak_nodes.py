"""The two-node job of the soak: one `lockstep run` per namespace, restartable, with logs.

Node 0 runs in host a, node 1 in host b; each launcher's output goes to
OUT/node{N}.log (appended to when node 1 is started again). `read_pids`,
`read_progress` and `read_batches` read what benchmarks/soak/soak_train.py writes.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from lockstep.testing.netns import Host, kill_inside

TRAIN = str(Path(__file__).with_name("soak_train.py"))
MASTER_PORT = 29561  # inside our own namespaces, so no other job can hold it


class Job:
    """A two-node `lockstep run` job of soak_train.py writing to `out`."""

    def __init__(self, hosts: tuple[Host, Host], out: Path, flags: list[str], script: list[str]):
        self.hosts, self.out, self.flags, self.script = hosts, out, flags, script
        # Both nodes need the same job secret; a scheduler would export it, this driver does.
        os.environ.setdefault("LOCKSTEP_JOB_SECRET", secrets.token_hex(32))
        out.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen | None] = [None, None]
        for node in (0, 1):
            self.start_node(node)

    def start_node(self, node: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "lockstep.cli",
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            self.hosts[0].address,
            "--master-port",
            str(MASTER_PORT),
            "--nproc-per-node",
            "2",
            *self.flags,
            TRAIN,
            "--out",
            str(self.out),
            *self.script,
        ]
        with open(self.out / f"node{node}.log", "a") as log:
            self.procs[node] = self.hosts[node].popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
            )

    def kill_launcher(self, node: int) -> None:
        proc = self.procs[node]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def kill_node(self, node: int) -> float:
        """SIGKILL every process in node's namespace (launcher and workers); the time."""
        killed_at = time.time()
        kill_inside(self.hosts[node].namespace)
        proc = self.procs[node]
        if proc is not None:
            proc.wait(timeout=30)
        return killed_at

    def ended(self) -> bool:
        """True once any launcher has exited (the driver then stops waiting)."""
        return any(proc is not None and proc.poll() is not None for proc in self.procs)

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes of both launchers; both are killed if they pass the deadline."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for node in (0, 1):
            proc = self.procs[node]
            assert proc is not None
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for node in (0, 1):
            self.kill_launcher(node)
        return codes

    def tail(self, lines: int = 40) -> str:
        logs = []
        for node in (0, 1):
            text = (self.out / f"node{node}.log").read_text(errors="replace").splitlines()
            logs.append(f"--- node {node} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(logs)


def read_pids(out: Path) -> dict[int, int]:
    """rank -> pid of the worker that wrote OUT/pids/RANK last."""
    pids = {}
    for path in (out / "pids").glob("[0-9]*"):
        if path.name.isdigit():
            pids[int(path.name)] = int(path.read_text())
    return pids


def read_progress(out: Path) -> tuple[int, int]:
    """(pid of rank 0, steps finished at its last save) from OUT/progress, or (0, 0) before."""
    try:
        pid, done = (out / "progress").read_text().split()
    except (OSError, ValueError):
        return 0, 0
    return int(pid), int(done)


def read_batches(out: Path, world_size: int) -> dict[tuple[int, int], tuple[int, list[int]]]:
    """(rank, step) -> (epoch, sample ids) from OUT/ids/RANK; a step's last line counts.

    A step is logged before it can finish, and logged again when it is done again (a
    whole-group restart redoes the steps after the last checkpoint, a live replacement
    the step it interrupted), so the last line of a step is what the run kept.

    Raises:
        ValueError: a line that is not "PID STEP EPOCH ID,ID,...", with its file and line.
    """
    batches: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for rank in range(world_size):
        path = out / "ids" / str(rank)
        lines = path.read_text().splitlines() if path.exists() else []
        for number, line in enumerate(lines, start=1):
            try:
                _pid, step, epoch, ids = line.split()
                batches[rank, int(step)] = int(epoch), [int(i) for i in ids.split(",")]
            except ValueError:
                raise ValueError(f"{path}:{number}: unreadable line {line!r}") from None
    return batches
