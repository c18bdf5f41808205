"""The launcher's exit watch: a worker whose script ended must leave within a grace.

The bootstrap notes the moment a worker's script ended well (`note_script_ended`),
before it ends the process groups and the interpreter shuts down. What runs after
that (atexit handlers, threads that are not daemons, a backend's destructor) cannot
change the result any more, but it can keep the process alive for ever. When every
live worker on this node has ended its script and one is still alive `grace_s` after
it, the agent asks it for its Python stack (SIGUSR2, as the stall watch does), logs
it, and ends it with SIGKILL; the run's result is what the scripts returned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerState

from lockstep.env import read_variable
from lockstep.launch.watches.stall import STACK_LINES, request_stack

DIR_VARIABLE = "LOCKSTEP_EXIT_DIR"

log = logging.getLogger("lockstep.run")


def ended_path(directory: str | Path, local_rank: int) -> Path:
    return Path(directory) / f"{local_rank}.ended"


def stack_path(directory: str | Path, local_rank: int) -> Path:
    return Path(directory) / f"{local_rank}.stack"


def note_script_ended() -> None:
    """In a worker: its script ended well; from now on only teardown runs (no-op unlaunched)."""
    directory = read_variable(DIR_VARIABLE)
    if directory:
        ended_path(directory, int(read_variable("LOCAL_RANK") or 0)).write_text("0\n")


class ExitWatch:
    """Ends this node's workers that outlive their finished script by more than `grace_s`.

    Args:
        directory: where workers write `<local rank>.ended` and `<local rank>.stack`.
        grace_s: seconds a worker may take to exit after its script ended.
    """

    def __init__(self, directory: Path, grace_s: float) -> None:
        self.directory = directory
        self.grace_s = grace_s
        self.reset()

    def reset(self) -> None:
        """A new round: forget the workers ended in the last one, and their notes."""
        self.ended: set[int] = set()
        for path in self.directory.glob("*.ended"):
            path.unlink(missing_ok=True)

    def check(self, workers: list[Worker]) -> None:
        """End the live workers whose script ended over `grace_s` ago, once no script runs."""
        alive = [w for w in workers if w.id and _alive(w.id)]
        since = {w.local_rank: _ended_at(self.directory, w.local_rank) for w in alive}
        if not alive or any(at is None for at in since.values()):
            return  # a script still runs: the stall watch, not this one, looks at it
        now = time.time()
        for worker in alive:
            late = now - (since[worker.local_rank] or now)
            if late > self.grace_s and worker.global_rank not in self.ended:
                self._end(worker, late)

    def excuse(self, result: RunResult, workers: list[Worker]) -> RunResult:
        """The run's result with workers whose script had succeeded counted as successes.

        Once the watch ends one late worker, torch's agent stops the others; those whose
        script had ended too, still inside their grace, succeeded as much as it did.
        """
        failed = set(result.failures)
        # also those stopped by torch's agent once the watch ended a peer, within their grace
        finished = self.ended | {w.global_rank for w in workers if self.script_ended(w)}
        if result.state != WorkerState.FAILED or not failed or not failed <= finished:
            return result
        log.warning(
            "rank(s) %s ended after their script succeeded (the exit watch ended %s): the run "
            "succeeded",
            ", ".join(map(str, sorted(failed))),
            ", ".join(map(str, sorted(self.ended))) or "none",
        )
        values = {w.global_rank: result.return_values.get(w.global_rank) for w in workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def script_ended(self, worker: Worker) -> bool:
        """Whether `worker`'s script ended well in this round (what remains is its exit)."""
        return _ended_at(self.directory, worker.local_rank) is not None

    def _end(self, worker: Worker, late: float) -> None:
        stack = dump_stack(worker.id or 0, stack_path(self.directory, worker.local_rank))
        log.error(
            "rank %d (local rank %d, pid %s) finished its script %.0f s ago but its process "
            "has not exited (--exit-grace %g); ending it with SIGKILL. Its script succeeded, "
            "so the run's result stands. Python stack of every thread:\n%s\nWhat to do: a "
            "thread that is not a daemon must end (join it, or make it a daemon), an atexit "
            "handler must not block, and a process group must be destroyed before the "
            "objects that use it (lockstep.teardown).",
            worker.global_rank,
            worker.local_rank,
            worker.id,
            late,
            self.grace_s,
            "\n".join(stack),
        )
        self.ended.add(worker.global_rank)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.id or 0, signal.SIGKILL)


def dump_stack(pid: int, path: Path) -> list[str]:
    """`pid`'s Python stack, as faulthandler writes it to `path` on DUMP_SIGNAL."""
    text = request_stack(pid, path)
    if text is None:
        return ["(no stack: the worker has exited)"]
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return ["(no stack: the worker wrote none)"]
    return lines[:STACK_LINES] + (["..."] if len(lines) > STACK_LINES else [])


def _ended_at(directory: Path, local_rank: int) -> float | None:
    try:
        return ended_path(directory, local_rank).stat().st_mtime
    except FileNotFoundError:
        return None


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
