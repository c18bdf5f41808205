"""The fork server: one process per node that imported ahead, and forks replacement workers.

Started by the launcher under `--live-recovery` (`forks.py`) as `python -u -m
lockstep.launch.recovery.forkserver --parent PID --fd N`, it imports what a spare
imports (`standby.PRELOAD`), freezes those objects out of the collector (`gc.freeze`:
a child's collections then leave the shared pages unwritten) and waits on socket N.
For each lost worker it checks it may fork (`fork_unsafe`), forks, and answers the
child's pid; the child becomes the worker as a spare does (`standby.run_as_worker`).
As the child's parent, it reports its exit status and reaps it once the launcher read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import socket
import sys
from typing import Any

from lockstep.launch.recovery import standby
from lockstep.launch.recovery.handover import BOOTSTRAP
from lockstep.launch.supervise import bootstrap

POLL_S = 1.0  # how often an idle server checks that its launcher is still there
# numpy's OpenBLAS (torch imports numpy) starts its thread pool at import, sized by these
# variables in this order, else by the cores: the server is started with the first at 1
# (`forks.ForkServer.start`).
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
BLAS_SETTERS = (
    "scipy_openblas_set_num_threads64_",  # numpy 2's bundled OpenBLAS
    "openblas_set_num_threads64_",  # numpy 1's
    "openblas_set_num_threads",  # a system OpenBLAS
)


def fork_unsafe() -> str | None:
    """Why this process may not fork, or None.

    A fork copies only the calling thread: a lock another thread held (in malloc, in an
    OpenMP or BLAS pool, in Python's own state) would stay locked in the child forever.
    And a child cannot use CUDA once its parent initialised it (torch raises "Cannot
    re-initialize CUDA in forked subprocess"); torch initialises it lazily, never here.
    """
    try:
        tasks = sorted(os.listdir("/proc/self/task"))
    except OSError as error:
        return f"cannot count its threads ({error})"
    if len(tasks) > 1:
        names = []
        for task in tasks:
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as fp:
                names.append(f"{task} {fp.read().strip()}")
        return f"it runs {len(tasks)} threads ({', '.join(names)}) where a fork needs 1"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in it, and a forked child could not use it"
    return None


def exit_code(pid: int) -> int:
    """The ended child's exit code as Popen gives it (-N: killed by signal N); not reaped."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    if info is None:  # cannot be: the child's pidfd said it ended
        return -1
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def blas_threads(env: dict[str, str]) -> int:
    """The thread count a new worker's OpenBLAS takes from `env` at import."""
    cores = len(os.sched_getaffinity(0))
    for name in BLAS_VARIABLES:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), cores)
    return cores


def restore_blas(env: dict[str, str]) -> None:
    """In the child: give OpenBLAS the thread count a new worker's would have (the server
    imported it with one), so the script's numpy runs as in any worker."""
    threads = blas_threads(env)
    if threads <= 1:
        return
    with open("/proc/self/maps") as fp:
        paths = {line.split()[-1] for line in fp if "openblas" in line.lower() and "/" in line}
    for path in paths:
        library = ctypes.CDLL(path)  # loaded already: its handle
        setter = next((getattr(library, n) for n in BLAS_SETTERS if hasattr(library, n)), None)
        if setter is not None:
            setter(ctypes.c_int(threads))


def with_parent(assignment: dict[str, Any], parent: int) -> dict[str, Any]:
    """The assignment with bootstrap's `--parent` set to `parent`: the child dies with the
    server, its parent (and the server with the launcher), not with the launcher it names."""
    args = list(assignment["args"])
    at = len(BOOTSTRAP)
    if args[at : at + 1] == ["--parent"]:
        args[at + 1] = str(parent)
    return {**assignment, "args": args}


class Server:
    """The server's loop: requests from the launcher, its children's ends.

    Args:
        channel: the socket to the launcher (`forks.ForkServer`), one JSON object a line.
        parent: the launcher's pid.
    """

    def __init__(self, channel: socket.socket, parent: int) -> None:
        self.channel = channel
        self.parent = parent
        self.children: dict[int, int] = {}  # pidfd -> pid, until the child ends
        self.buffer = b""

    def serve(self) -> dict[str, Any] | None:
        """Serve until the launcher has gone: None. In a forked child, its assignment."""
        reason = fork_unsafe()
        if reason is not None:
            self.send({"refused": reason})
            return None
        self.send({"ready": os.getpid()})
        while True:
            ready, _, _ = select.select([self.channel, *self.children], [], [], POLL_S)
            if not ready and os.getppid() != self.parent:
                return None
            for fd in ready:
                if fd is not self.channel:
                    self.report(fd)
                    continue
                requests = self.receive()
                if requests is None:
                    return None
                for request in requests:
                    assignment = self.handle(request)
                    if assignment is not None:
                        return assignment

    def receive(self) -> list[dict[str, Any]] | None:
        """The complete requests read now; None when the launcher closed the socket."""
        data = self.channel.recv(1 << 16)
        if not data:
            return None
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines]

    def handle(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Fork for a `fork` request (the child gets its assignment back); reap for `reap`."""
        if "reap" in request:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(request["reap"], 0)
            return None
        reason = fork_unsafe()
        if reason is not None:
            self.send({"refused": reason})
            raise SystemExit(1)
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            self.leave(server)
            return request["fork"]
        self.children[os.pidfd_open(pid)] = pid
        self.send({"forked": pid, "id": request["id"]})
        return None

    def leave(self, server: int) -> None:
        """In the child: its own session (as torch starts workers), none of the server's
        descriptors, and death with the server (which dies with the launcher)."""
        os.setsid()
        for pidfd in self.children:
            os.close(pidfd)
        self.channel.close()
        bootstrap.die_with(server)

    def report(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        os.close(pidfd)
        self.send({"ended": pid, "code": exit_code(pid)})

    def send(self, message: dict[str, Any]) -> None:
        self.channel.sendall(json.dumps(message).encode() + b"\n")


def main(argv: list[str]) -> None:
    parent, fd = int(argv[1]), int(argv[3])  # --parent PID --fd N
    bootstrap.die_with(parent)
    standby.preload()
    gc.freeze()
    channel = socket.socket(fileno=fd)
    try:
        assignment = Server(channel, parent).serve()
    except OSError:  # the launcher has gone (a broken pipe): nothing to serve
        return
    if assignment is not None:  # a child, out of the server's loop
        restore_blas(assignment["env"])
        standby.run_as_worker(with_parent(assignment, os.getppid()))


if __name__ == "__main__":
    main(sys.argv[1:])
