"""Waits that say what they wait on, and a stall inspector that names the ranks missing.

`wait(handle, what, step, index, group)` is how the engine waits on a collective: a
collective already finished costs one poll; otherwise the wait is noted in the
progress record (`lockstep.runtime.progress`) and the inspector thread watches it.
A wait longer than LOCKSTEP_STALL_WARN_S (default 30 s) is logged on this rank,
and again every period, with the ranks that have not launched the same collective:
each waiting rank posts what it waits on to the process group's store (only then,
never on the happy path) and reads the others' posts, as Horovod's stall inspector
does. It works under any launcher; `lockstep run` additionally ends a stalled run.
Under other launchers (torchrun, Slurm, mpirun) LOCKSTEP_STALL_TIMEOUT_S bounds a
wait: past it the waiting rank exits, its message (and torchrun's error file)
naming the rank(s) that never launched the collective, so the run ends blaming them.
Under live recovery a wait polls instead of blocking, so that the announcement of a
new generation ends it (`interrupt_with`, `live/registry.py`) with `Interrupted`.
`block` is the same wait without the progress note (a checkpoint's messages), with
an optional bound of its own (a checkpoint's barrier).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from lockstep.env import read_seconds, read_variable
from lockstep.runtime import error_files, progress, threads
from lockstep.runtime.handles import CollectiveHandle, WorkHandle

WARN_VARIABLE = "LOCKSTEP_STALL_WARN_S"
DEFAULT_WARN_S = 30.0
END_VARIABLE = "LOCKSTEP_STALL_TIMEOUT_S"  # unset: waits end only at the group's timeout
STALL_EXIT_CODE = 3
KEY = "lockstep/stall/{rank}"
log = logging.getLogger("lockstep.stall")


@dataclass
class _Wait:
    """The collective this rank waits on now."""

    what: str  # identical on every rank that launched the same collective
    step: int
    group: dist.ProcessGroup | None
    since: float
    posted: bool = False
    logged: int = 0  # warnings logged so far


class StallInspector:
    """A daemon thread that wakes a few times per warning period while a wait is open.

    It ends when a process group is destroyed or the last wrapped model is collected
    (`runtime/threads.py`); the next wait starts another.
    """

    def __init__(self, warn_s: float, end_s: float | None = None) -> None:
        self.warn_s = warn_s
        self.end_s = end_s
        self.current: _Wait | None = None
        self.last_message = ""  # the last warning logged, for tests and post-mortems
        self.lock = threading.Lock()  # a post and its withdrawal never cross
        self._thread = threads.LockstepThread("lockstep-stall", self._run)
        self._thread.start()
        threads.serves_wrapped_models(self)
        weakref.finalize(self, self._thread.stop)  # at exit at the latest

    def stop(self) -> None:
        self._thread.stop()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._thread.stopping.is_set()

    def _run(self, stopping: threading.Event) -> None:
        first = min(self.warn_s, self.end_s or self.warn_s)
        tick = max(0.05, min(1.0, first / 4))
        while not stopping.wait(tick):
            wait = self.current
            if wait is None:
                continue
            age = time.monotonic() - wait.since
            try:
                with self.lock:
                    if self.current is wait and not wait.posted and age >= first / 2:
                        _post(wait)
                if age >= self.warn_s * (wait.logged + 1):
                    wait.logged += 1
                    self.last_message = _warn(wait, age)
                if self.end_s is not None and age >= self.end_s:
                    _end(wait, age, self.end_s)
            except Exception as error:  # the store may be gone; the wait itself reports
                log.debug("stall inspector: %s", error)


def _my_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _post(wait: _Wait) -> None:
    store = _store()
    if store is not None:
        store.set(KEY.format(rank=_my_rank()), f"{wait.what}\n{wait.what}")
    wait.posted = True


def _withdraw(wait: _Wait) -> None:
    """The wait is over: remove its post, so no rank reads it as where this one is now."""
    store = _store()
    if store is not None and wait.posted:
        store.delete_key(KEY.format(rank=_my_rank()))


def _others(wait: _Wait) -> dict[int, str | None]:
    """Every other rank of the group: what it posted last (None: nothing)."""
    store = _store()
    if store is None:
        return {}
    ranks = dist.get_process_group_ranks(wait.group or dist.group.WORLD)
    seen: dict[int, str | None] = {}
    for rank in ranks:
        key = KEY.format(rank=rank)
        if rank != _my_rank():
            seen[rank] = store.get(key).decode() if store.check([key]) else None
    return seen


def missing_ranks(wait: _Wait, others: dict[int, str | None]) -> dict[int, str]:
    """Rank -> where it is, for each rank that has not launched `wait`'s collective."""
    missing = {}
    for rank, posted in sorted(others.items()):
        if posted is None:
            missing[rank] = "not waiting in any lockstep collective"
        elif posted.split("\n", 1)[0] != wait.what:
            missing[rank] = f"last seen waiting on {posted.split(chr(10), 1)[-1]}"
    return missing


def missing_line(wait: _Wait, others: dict[int, str | None]) -> str:
    """'rank(s) 1 have not launched it (rank 1: no wait posted)', or '' when all have."""
    missing = missing_ranks(wait, others)
    if not missing:
        return ""
    where = "; ".join(f"rank {rank}: {at}" for rank, at in missing.items())
    return f"rank(s) {', '.join(map(str, missing))} have not launched it ({where})"


def _warn(wait: _Wait, age: float) -> str:
    """Log the wait and who is missing on stderr; put it in the progress record; return it."""
    missing = missing_line(wait, _others(wait))
    detail = f"; {missing}" if missing else "; every rank of the group is waiting on it too"
    progress.current().set_label(f"{wait.what}{detail}")
    message = (
        f"lockstep [rank {_my_rank()}]: waited {age:.0f} s on {wait.what}{detail}. "
        "A rank that has not launched it is stuck or on another code path (uneven data, a "
        "rank-only branch, a collective of its own); its own log and stack show where."
    )
    print(message, file=sys.stderr, flush=True)
    return message


def _end(wait: _Wait, age: float, end_s: float) -> None:
    """Past LOCKSTEP_STALL_TIMEOUT_S: say who is missing, in torchrun's error files too; exit.

    The stuck ranks come first in the message, and a stuck rank on this node gets its
    own error file, so torchrun's "Root Cause" names it (`runtime/error_files.py`).
    """
    me, others = _my_rank(), _others(wait)
    missing, stuck = missing_line(wait, others), missing_ranks(wait, others)
    bound = f"({END_VARIABLE}={end_s:g})"
    blame = (
        f"stuck: {missing}, the {wait.what} that rank {me} waited on for {age:.0f} s; "
        f"rank {me} only waited for them and ended the run {bound}"
        if missing
        else f"rank {me} waited {age:.0f} s on {wait.what} {bound}, and every rank of the "
        "group is waiting on it too (a rank on another path?)"
    )
    message = (
        f"lockstep [rank {me}]: {blame}. Their own logs show where they stopped; a rank "
        "that is alive but stuck can be inspected with py-spy dump."
    )
    print(message, file=sys.stderr, flush=True)
    now = int(time.time())
    began = min(int(time.time() - age), now - 1)  # earlier than this rank's own failure
    for rank, at in stuck.items():
        error_files.name_stuck(
            rank,
            f"lockstep: rank {rank} is stuck: it never launched {wait.what}, which rank {me} "
            f"waited on for {age:.0f} s ({at}); rank {me}'s stall bound ended the run "
            f"{bound}. Rank {rank}'s own log shows where it stopped.",
            began,
        )
    error_files.write_own(message, now)  # what torchrun prints as this rank's failure
    os._exit(STALL_EXIT_CODE)  # the main thread is blocked inside the collective


_inspector: StallInspector | None = None
_interrupts: list[Callable[[], None]] = []  # live recovery: raises when a rank was lost
INTERRUPT_CHECK_S = 0.2


class Interrupted(RuntimeError):
    """A wait ended because a rank of the group was lost (a new generation was announced)."""


def interrupt_with(check: Callable[[], None]) -> None:
    """Under live recovery, a wait polls and calls `check` every INTERRUPT_CHECK_S: a rank
    whose peers in the collective are alive would otherwise wait on a dead group for ever."""
    _interrupts[:] = [check]


def block(handle: CollectiveHandle, timeout_s: float | None = None) -> None:
    """Wait on `handle` without a progress note (a checkpoint's messages: the rank stays
    "in a save" for the stall watch); polls under live recovery or with a bound.

    Raises:
        Interrupted: under live recovery, a rank of the group was lost meanwhile.
        RuntimeError: the collective failed, or `timeout_s` passed.
    """
    if not _interrupts and timeout_s is None:
        handle.wait()
        return
    start = time.monotonic()
    pause, next_check = 5e-5, start + INTERRUPT_CHECK_S
    while not handle.poll():
        time.sleep(pause)
        pause = min(2 * pause, 0.002)
        now = time.monotonic()
        if _interrupts and now >= next_check:
            _interrupts[0]()
            next_check = now + INTERRUPT_CHECK_S
        if timeout_s is not None and now - start >= timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:g} s")
    handle.wait()


def inspector() -> StallInspector:
    """The process's inspector, started at an open wait when none runs; stopped at exit."""
    global _inspector
    if _inspector is None or not _inspector.alive():
        warn_s = read_seconds(WARN_VARIABLE, DEFAULT_WARN_S)
        end = read_variable(END_VARIABLE)
        _inspector = StallInspector(warn_s, read_seconds(END_VARIABLE, 1.0) if end else None)
    return _inspector


def collective(work: dist.Work | None, what: str, group: dist.ProcessGroup | None) -> None:
    """Wait on a collective lockstep started with async_op=True, watched as the buckets are.

    Every collective of the engine goes through here or `wait`, so a rank blocked in
    any of them (the bucket rebuild's broadcast, the unused-parameter vote, the replicas'
    broadcasts) shows as waiting, naming it, to the stall inspector and the launcher.
    """
    if work is not None:  # None: this rank is not in the group
        record = progress.current()
        step = record.step + (record.phase == progress.Phase.SYNCHRONISED)
        wait(WorkHandle(work), what, step, -1, group)


def wait(
    handle: CollectiveHandle,
    kind: str,
    step: int,
    index: int,
    group: dist.ProcessGroup | None,
    phase: progress.Phase = progress.Phase.WAITING,
) -> None:
    """Wait on `handle`; if it is not done yet, note the wait and let the inspector watch it.

    Args:
        handle: the collective in flight.
        kind: what it is, for messages: "gradient bucket", "step fingerprint".
        step: the synchronised step it belongs to (0: before the first).
        index: the bucket's index (-1 for other collectives).
        group: the process group it runs over (the default group when None).
        phase: a waiting phase: inside a step (`WAITING`), at its start, between steps.

    Raises:
        Interrupted: under live recovery, a rank of the group was lost meanwhile.
        RuntimeError: the collective failed.
    """
    if handle.poll():
        handle.wait()  # gloo marks a failed work completed too: its wait() raises the error
        return
    what = f"{kind} {index}" if index >= 0 else kind
    what += f" of step {step}" if step > 0 else ""
    watch = inspector()
    with progress.during(phase, step, index, what):
        mine = watch.current = _Wait(what, step, group, time.monotonic())
        try:
            block(handle)
        finally:
            with watch.lock:
                watch.current = None
                if mine.posted:
                    _withdraw(mine)
