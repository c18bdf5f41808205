"""Standby workers for live recovery (`lockstep run --live-recovery --spares K`).

A replacement started from nothing spends most of a live recovery starting Python
and importing torch. `SparePool` keeps K processes per node that have done that
already (`launch/recovery/standby.py`) and hold no rank: they are not in any rendezvous,
group or world size. When `LiveReplacer` replaces a worker, `handover.start_worker` hands
the worker's environment and arguments to an idle spare, which then runs the
script, and its handle takes the worker's place in torch's process context (exit
codes, stop and restart as for any worker). A new spare is started in its place
once the recovery is over (`handover.py` has what spares share with the fork server's
children). Spares die with the launcher (the kernel's parent-death
signal, like the workers) and are killed when the run ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any, NamedTuple

from lockstep.launch.recovery.handover import ReadyHandler

log = logging.getLogger("lockstep.run")
REFILL_DELAY_S = 0.5  # after a recovery formed: keep the start of a new spare out of it
PIPE_BYTES = 1 << 20  # the assignment is written at once: the spare may still be importing
MAX_DEATHS = 3  # idle spares that died before the pool stops starting new ones
REAP_S = 5.0


class Spare(NamedTuple):
    proc: subprocess.Popen
    pipe: int  # the write end of the spare's assignment pipe
    capacity: int  # bytes the pipe holds


class SparePool:
    """One node's idle spares.

    Args:
        size: how many spares to keep idle (K of --spares).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[Spare] = []
        self._refill_after = 0.0  # time.monotonic() before which no spare starts
        self._deaths = 0

    def refill(self, recovering: bool) -> None:
        """Start spares up to `size`; not while a recovery runs, nor just after it."""
        now = time.monotonic()
        if recovering:
            self._refill_after = now + REFILL_DELAY_S
            return
        self._drop_dead()
        if now < self._refill_after or self._deaths >= MAX_DEATHS:
            return
        while len(self._idle) < self.size:
            self._idle.append(self._start())

    def assign(self, local_rank: int, assignment: dict[str, Any]) -> ReadyHandler | str:
        """Send the worker's environment, arguments and output files to an idle spare.

        Returns:
            The spare's handle (it is now the worker), or why none took it: no idle spare
            is alive, or the assignment does not fit in its pipe at once.
        """
        self._drop_dead()
        message = json.dumps(assignment).encode()
        while self._idle and len(message) <= self._idle[0].capacity:
            spare = self._idle.pop(0)
            try:
                os.write(spare.pipe, message)  # whole: it fits in the pipe's buffer
            except OSError as error:  # it died since: the next one
                log.warning("spare pid %d could not be given its rank: %s", spare.proc.pid, error)
                _kill(spare.proc)
                continue
            finally:
                os.close(spare.pipe)
            log.warning("spare pid %d takes local rank %d", spare.proc.pid, local_rank)
            return ReadyHandler(spare.proc, local_rank)
        if self._idle:
            return f"the assignment ({len(message)} bytes) does not fit a spare's pipe at once"
        return "no idle spare"

    def close(self) -> None:
        """Kill and reap every idle spare (the run is over)."""
        for spare in self._idle:
            _kill(spare.proc)
            os.close(spare.pipe)
            log.info("spare pid %d ended with the run", spare.proc.pid)
        self._idle = []

    def _start(self) -> Spare:
        read, write = os.pipe()
        with contextlib.suppress(OSError):  # above the system's pipe-max-size: its default
            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        capacity = fcntl.fcntl(write, fcntl.F_GETPIPE_SZ)
        argv = [sys.executable, "-u", "-m", "lockstep.launch.recovery.standby"]
        argv += ["--parent", str(os.getpid()), "--fd", str(read)]
        # Its own session, as torch starts workers: the handle stops its process group.
        proc = subprocess.Popen(argv, pass_fds=(read,), start_new_session=True)
        os.close(read)
        log.info("spare pid %d started (%d per node)", proc.pid, self.size)
        return Spare(proc, write, capacity)

    def _drop_dead(self) -> None:
        for spare in [s for s in self._idle if s.proc.poll() is not None]:
            self._idle.remove(spare)
            os.close(spare.pipe)
            self._deaths += 1
            log.warning(
                "spare pid %d ended with code %d while idle%s",
                spare.proc.pid,
                spare.proc.returncode,
                "; no more spares" if self._deaths >= MAX_DEATHS else "",
            )


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        log.warning("spare pid %d did not end within %.0f s of SIGKILL", proc.pid, REAP_S)
