"""A standby worker: imports ahead, waits for a rank, then runs the script as a worker would.

`lockstep run --live-recovery --spares K` starts K of these per node as `python -u
-m lockstep.launch.recovery.standby --parent PID --fd N`. Each imports `PRELOAD` (torch,
lockstep and the modules a worker imports lazily on its way to its first step),
then waits on the pipe N for one assignment from the launcher (`launch/recovery/spares.py`):
the worker's environment, its bootstrap arguments and its output files. It then
becomes that worker: os.environ, output and sys.argv as torch's agent would have
given a new process, and the script run by `lockstep.launch.supervise.bootstrap` as `__main__`.
The script's own imports are not run ahead: they run once, in the script, as always.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys

import lockstep.live
from lockstep.launch.recovery.handover import BOOTSTRAP
from lockstep.launch.supervise import bootstrap

# Imported before any rank is known: no side effect that depends on the worker's
# environment. torch._dynamo is the first wrap's lazy import (seconds on a busy machine).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "lockstep",
    "lockstep.live",
    "lockstep.launch.watches.exits",
)
POLL_S = 1.0  # how often a waiting spare checks that its launcher is still there
EOF = b""


def _read_assignment(fd: int, parent: int) -> dict | None:
    """The launcher's one message; None when it closed the pipe (retired) or has gone."""
    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            if os.getppid() != parent:
                return None
            continue
        chunk = os.read(fd, 1 << 16)
        if chunk == EOF:
            return json.loads(data) if data else None
        data += chunk


def _redirect(path: str, target: int) -> None:
    """Send fd `target` to `path` (appended: a replaced worker's output stays above)."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, target)
    os.close(fd)


def _become(assignment: dict) -> list[str]:
    """Take the worker's environment and output; returns bootstrap's arguments."""
    os.environ.clear()
    os.environ.update(assignment["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(assignment["stdout"], 1)
    _redirect(assignment["stderr"], 2)
    args = assignment["args"]
    if tuple(args[: len(BOOTSTRAP)]) != BOOTSTRAP:
        raise SystemExit(f"a spare runs lockstep's bootstrap; was given {args[:3]}")
    return args[len(BOOTSTRAP) :]


def preload() -> None:
    """Import what a worker imports on its way to its first step (`PRELOAD`)."""
    for name in PRELOAD:
        importlib.import_module(name)


def run_as_worker(assignment: dict) -> None:
    """Become the worker the launcher assigned, and run its script as `__main__`.

    The one handover of a process that imported ahead: a spare's, and a fork
    server's child's (`forkserver.py`).
    """
    argv = _become(assignment)
    lockstep.live.install()  # read again: the environment at import had no rank, no generation
    bootstrap.main(argv)


def main(argv: list[str]) -> None:
    parent, fd = int(argv[1]), int(argv[3])  # --parent PID --fd N
    bootstrap.die_with(parent)
    preload()
    assignment = _read_assignment(fd, parent)
    os.close(fd)
    if assignment is not None:
        run_as_worker(assignment)


if __name__ == "__main__":
    main(sys.argv[1:])
