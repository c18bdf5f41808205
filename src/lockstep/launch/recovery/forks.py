"""The node's fork server, seen from the launcher: start it, ask it for a worker, end it.

Under `--live-recovery` each launcher starts one fork server (`forkserver.py`): a
process that imported what a worker imports and holds no rank. When no spare is
idle, `ForkServer.assign` asks it for a child, which becomes the worker in
milliseconds (`handover.py`), its imported modules shared copy-on-write. The child is
the server's: `ForkedProcess` gives torch's agent the Popen calls it uses. If the
server has ended or does not answer, a new process takes the rank, said in one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from lockstep.launch.recovery.handover import ReadyHandler

log = logging.getLogger("lockstep.run")
READY_WAIT_S = 10.0  # a loss before the server finished its imports: it is still ahead
REPLY_S = 10.0  # a fork takes milliseconds; past this the server is ended
REAP_S = 5.0
POLL_S = 0.01  # ForkedProcess.wait's interval
# numpy's OpenBLAS would start a thread pool at import (torch imports numpy), and a
# process that forks must run one thread: its child gets the worker's count back
# (`forkserver.restore_blas`).
SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1"}


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class ForkServer:
    """This node's fork server: one process, started once, ended with the run."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._channel: socket.socket | None = None
        self._buffer = b""
        self._ready = False
        self._gone: str | None = None  # why it forks no more
        self._forked: dict[int, int] = {}  # request id -> the child's pid
        self._codes: dict[int, int] = {}  # pid -> exit code, from the server
        self._requests = 0

    def start(self) -> None:
        """Start the server, once (each watch step calls this)."""
        if self.proc is not None or self._gone is not None:
            return
        if not hasattr(os, "pidfd_open"):
            self._gone = "this system has no pidfd_open (Linux 5.3 or later)"
            return
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-u", "-m", "lockstep.launch.recovery.forkserver"]
        argv += ["--parent", str(os.getpid()), "--fd", str(theirs.fileno())]
        # Its own session, as torch starts workers: Ctrl-C reaches the launcher alone.
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **SERVER_ENV},
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        self._channel = ours
        log.info("fork server pid %d started", self.proc.pid)

    def assign(self, local_rank: int, assignment: dict[str, Any]) -> ReadyHandler | str:
        """Fork a child that becomes the worker of `local_rank`.

        Returns:
            Its handle, or why the server could not (it has ended, refused, did not answer).
        """
        if self._channel is None or not self._wait(lambda: self._ready or None, READY_WAIT_S):
            return self._declined(f"not ready within {READY_WAIT_S:.0f} s")
        request = self._requests
        self._requests += 1
        try:
            self._channel.sendall(json.dumps({"fork": assignment, "id": request}).encode() + b"\n")
        except OSError as error:
            self._lose(f"its socket failed ({error})")
        pid = self._wait(lambda: self._forked.pop(request, None), REPLY_S)
        if pid is None:
            if self._gone is None:  # it may still fork: end it (its children die with it)
                self._lose(f"no answer within {REPLY_S:.0f} s; ended")
                self._end(0)
            return self._declined("")
        log.warning(
            "fork server pid %d forked pid %d for local rank %d", self.proc.pid, pid, local_rank
        )
        return ReadyHandler(ForkedProcess(self, pid), local_rank)

    def exit_code(self, pid: int, ended: Callable[[], bool]) -> int | None:
        """`pid`'s exit code once the server reported it (then it is reaped). With the
        server gone, a child that `ended` is taken as killed by SIGKILL: its parent-death
        signal, the server's end being the reason it ended."""
        self._receive()
        code = self._codes.pop(pid, None)
        if code is not None:
            self._send({"reap": pid})
            return code
        if self._gone is not None and ended():
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        """The run is over: end the server (a child still running dies with it) and reap it."""
        if self.proc is None:
            return
        self._receive()
        before = self._gone  # it had ended, or refused, while the run went on
        self._end(REAP_S if self._ready else 0)  # one still importing reads no socket yet
        code = self.proc.returncode
        if code is None:
            ended = "has not ended"
        elif before is not None:
            ended = f"had ended ({_describe(code)}; {before})"
        else:
            ended = f"ended with the run ({_describe(code)})"
        log.info("fork server pid %d %s", self.proc.pid, ended)

    def _end(self, patience_s: float) -> None:
        """Close its socket (an idle server then leaves at once); SIGKILL it after
        `patience_s` seconds."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=patience_s)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=REAP_S)

    def _declined(self, why: str) -> str:
        """The reason a new process takes the rank, in one line."""
        pid = self.proc.pid if self.proc is not None else None
        if self._gone is None:
            return f"the fork server (pid {pid}) was {why}"
        if self.proc is not None and self.proc.poll() is not None:
            ended = _describe(self.proc.returncode)
            return f"the fork server (pid {pid}) has ended ({ended}; {self._gone})"
        return f"the fork server (pid {pid}) forks no more: {self._gone}"

    def _lose(self, reason: str) -> None:
        if self._gone is None:
            self._gone = reason

    def _wait(self, value: Callable[[], Any], timeout: float) -> Any:
        """`value()` once it is not None, reading the server's lines meanwhile; None when
        the server has gone or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while True:
            self._receive()
            got = value()
            left = deadline - time.monotonic()
            if got is not None or self._gone is not None or left <= 0 or self._channel is None:
                return got
            select.select([self._channel], [], [], left)

    def _receive(self) -> None:
        """Read every line the server has sent so far (never blocks)."""
        while self._channel is not None and select.select([self._channel], [], [], 0)[0]:
            try:
                data = self._channel.recv(1 << 16)
            except OSError as error:
                data, reason = b"", f"its socket failed ({error})"
            else:
                reason = "its socket closed"
            if not data:
                self._lose(reason)
                self._channel.close()
                self._channel = None
                return
            self._buffer += data
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._take(json.loads(line))

    def _take(self, message: dict[str, Any]) -> None:
        if "ready" in message:
            self._ready = True
        elif "refused" in message:
            self._lose(f"it refused to fork: {message['refused']}")
        elif "forked" in message:
            self._forked[message["id"]] = message["forked"]
        elif "ended" in message:
            self._codes[message["ended"]] = message["code"]

    def _send(self, message: dict[str, Any]) -> None:
        if self._channel is None:
            return
        try:
            self._channel.sendall(json.dumps(message).encode() + b"\n")
        except OSError as error:
            self._lose(f"its socket failed ({error})")


class ForkedProcess:
    """A fork server's child, with the Popen calls torch's agent and the replacer use.

    Args:
        server: the server that forked it (the child's parent, which reports its end).
        pid: the child's pid.
    """

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        try:  # a handle on this very process: its pid may be reused once it is reaped
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # it ended already
            self._pidfd = None

    def poll(self) -> int | None:
        """Its exit code (negative: the signal), or None while it runs."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, self._ended)
            if self.returncode is not None and self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; raises subprocess.TimeoutExpired after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _ended(self) -> bool:
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], 0)[0])
