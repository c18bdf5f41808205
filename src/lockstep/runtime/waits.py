"""Waits that say what they wait on, and a stall inspector that names the ranks missing.

`wait(handle, what, step, index, group)` is how the engine waits on a collective: a
collective already finished costs one poll; otherwise the wait is noted in the
progress record (`lockstep.runtime.progress`) and the inspector thread watches it.
A wait longer than LOCKSTEP_STALL_WARN_S (default 30 s) is logged on this rank,
and again every period, with the ranks that have not launched the same collective:
each waiting rank posts what it waits on to the process group's store (only then,
never on the happy path) and reads the others' posts, as Horovod's stall inspector
does. It works under any launcher; `lockstep run` additionally ends a stalled run.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from lockstep.env import read_seconds
from lockstep.runtime import progress
from lockstep.runtime.handles import CollectiveHandle

WARN_VARIABLE = "LOCKSTEP_STALL_WARN_S"
DEFAULT_WARN_S = 30.0
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
    """A daemon thread that wakes a few times per warning period while a wait is open."""

    def __init__(self, warn_s: float) -> None:
        self.warn_s = warn_s
        self.current: _Wait | None = None
        self.last_message = ""  # the last warning logged, for tests and post-mortems
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-stall", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        tick = max(0.05, min(1.0, self.warn_s / 4))
        while not self._stop.wait(tick):
            wait = self.current
            if wait is None:
                continue
            age = time.monotonic() - wait.since
            try:
                if not wait.posted and age >= self.warn_s / 2:
                    _post(wait)
                if age >= self.warn_s * (wait.logged + 1):
                    wait.logged += 1
                    self.last_message = _warn(wait, age)
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


def missing_line(wait: _Wait, others: dict[int, str | None]) -> str:
    """'rank(s) 1 have not launched it (rank 1: no wait posted)', or '' when all have."""
    missing = []
    for rank, posted in sorted(others.items()):
        if posted is None:
            missing.append(f"rank {rank}: not waiting in any lockstep collective")
        elif posted.split("\n", 1)[0] != wait.what:
            missing.append(f"rank {rank}: last seen waiting on {posted.split(chr(10), 1)[-1]}")
    if not missing:
        return ""
    ranks = ", ".join(m.split(":")[0].removeprefix("rank ") for m in missing)
    return f"rank(s) {ranks} have not launched it ({'; '.join(missing)})"


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


_inspector: StallInspector | None = None


def inspector() -> StallInspector:
    """The process's inspector, started at the first open wait; stopped at exit."""
    global _inspector
    if _inspector is None:
        warn_s = read_seconds(WARN_VARIABLE, DEFAULT_WARN_S)
        _inspector = StallInspector(warn_s)
        atexit.register(_inspector.stop)
    return _inspector


def wait(
    handle: CollectiveHandle,
    kind: str,
    step: int,
    index: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Wait on `handle`; if it is not done yet, note the wait and let the inspector watch it.

    Args:
        handle: the collective in flight.
        kind: what it is, for messages: "gradient bucket", "step fingerprint".
        step: the synchronised step it belongs to.
        index: the bucket's index (-1 for other collectives).
        group: the process group it runs over (the default group when None).
    """
    if handle.poll():
        return
    what = f"{kind} {index} of step {step}" if index >= 0 else f"{kind} of step {step}"
    progress.note(progress.Phase.WAITING, step, index, what)
    watch = inspector()
    watch.current = _Wait(what, step, group, time.monotonic())
    try:
        handle.wait()
    finally:
        watch.current = None
