"""The launcher's progress watch: end a stalled run and blame the rank that stopped, not its peers.

Workers note their step and phase in memory-mapped files (`lockstep.runtime.progress`);
the agent calls `StallWatch.check` at every look at its workers. When no local worker
has progressed for `timeout_s`, `judge` decides: a worker that is stopped (state T in
/proc/<pid>/stat: SIGSTOP, Ctrl-Z, a debugger) is the stuck one, whatever phase it
noted last (a wait, a save); without one, the workers that do not wait in a collective
are stuck, once at least one waits. Each stuck worker that runs gets SIGUSR2, which
makes faulthandler (armed by `lockstep.launch.supervise.bootstrap`) write its Python
stack to a file; a stopped one cannot, and is named as frozen. The stuck rank becomes
the first failure and the others its echoes, with what they wait on.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.agent.server.api import Worker

from lockstep.launch.supervise.group import WorkerFailure
from lockstep.runtime import progress
from lockstep.runtime.progress import Phase, Record

DUMP_SIGNAL = signal.SIGUSR2
STACK_LINES = 40
DUMP_WAIT_S = 3.0
FROZEN_STATES = ("T", "t")  # stopped by a signal; stopped by a tracer
OTHER_NODE_GRACE_S = 10.0  # every local rank waits: give the stuck rank's node time to report


def stack_path(directory: str | Path, local_rank: int) -> Path:
    return Path(directory) / f"{local_rank}.stack"


def request_stack(pid: int, path: Path) -> str | None:
    """Ask `pid` for its Python stack (DUMP_SIGNAL; faulthandler writes it to `path`).

    Returns what it wrote once the file stops growing, bounded by DUMP_WAIT_S ("" if
    nothing), or None when the process no longer exists.
    """
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return None
    deadline, size = time.monotonic() + DUMP_WAIT_S, -1
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = path.stat().st_size if path.exists() else 0
        if now and now == size:
            break
        size = now
    return path.read_text(errors="replace") if path.exists() else ""


# How far a worker got inside one step (`Record.step`), for `judge`'s order
_PHASE_ORDER = {
    Phase.STARTING: 0,
    Phase.OPENING: 1,  # waiting on a collective that opens the step
    Phase.BACKWARD: 2,
    Phase.WAITING: 3,
    Phase.SYNCHRONISED: 4,
    Phase.BETWEEN: 5,  # waiting on a collective after the step
    Phase.CHECKPOINT: 6,  # a save after the step (the script's own step number)
}


def advance(record: Record | None) -> tuple[int, int, int]:
    """How far a worker got: its step, then its phase in the step, then the bucket."""
    if record is None:
        return (-1, 0, -1)
    return (record.step, _PHASE_ORDER[record.phase], record.index)


def judge(
    records: Mapping[int, Record | None], stopped: Collection[int]
) -> tuple[list[int], list[int]] | None:
    """Who is stuck and who waits for it, by local rank; None when no one waits for anyone.

    A stopped process runs nothing, so it is stuck whatever it noted last, a wait on
    a collective or a save (whose own messages note no wait); the others only wait for
    it and are never blamed. Without one, the workers that are not waiting in a
    collective are stuck, once at least one waits (none waiting: they all compute).
    Each list is least advanced first (`advance`): of two stuck ranks the one behind is
    the likelier cause, and it is the one named first.

    Args:
        records: each local worker's last progress record (None: none yet).
        stopped: the local ranks whose process is stopped (state T or t).

    Returns:
        (stuck, waiting): every worker is in one; stuck is empty when every worker
        waits in a collective and none is stopped (the stuck rank is not here to see).
    """
    if any(rank in records for rank in stopped):
        stuck = [rank for rank in records if rank in stopped]
    elif any(_is_waiting(record) for record in records.values()):
        stuck = [rank for rank, record in records.items() if not _is_waiting(record)]
    else:
        return None
    waiting = [rank for rank in records if rank not in stuck]
    return (
        sorted(stuck, key=lambda rank: advance(records[rank])),
        sorted(waiting, key=lambda rank: advance(records[rank])),
    )


@dataclass(frozen=True)
class Stall:
    """What the watch found: failures (stuck ranks first) and the lines the launcher logs."""

    failures: list[WorkerFailure]
    message: str
    stuck: tuple[int, ...] = ()  # local ranks of the stuck workers (none: all wait)


class StallWatch:
    """Watches this node's workers' progress files.

    Args:
        directory: where workers write `<local rank>.progress` and `<local rank>.stack`.
        timeout_s: seconds without progress on this node before the run is ended.
        nnodes: nodes in the job; with several, a node whose ranks all wait waits longer.
    """

    def __init__(self, directory: Path, timeout_s: float, nnodes: int) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.nnodes = nnodes
        self.reset()

    def reset(self) -> None:
        """A new round: forget the last one's records and files."""
        self._seen: dict[int, int] = {}
        self._since = time.monotonic()
        for path in self.directory.glob("*.*"):
            path.unlink(missing_ok=True)

    def check(self, workers: list[Worker], node_rank: int, host: str) -> Stall | None:
        """A `Stall` when this node's workers stopped progressing and `judge` finds who
        waits for whom; else None."""
        now = time.monotonic()
        records = {w.local_rank: progress.read(self._progress(w)) for w in workers}
        for local_rank, record in records.items():
            seq = record.seq if record else 0
            if self._seen.get(local_rank) != seq:
                self._seen[local_rank] = seq
                self._since = now
        quiet = now - self._since
        if quiet < self.timeout_s:
            return None
        verdict = judge(records, {w.local_rank for w in workers if _frozen(w)})
        if verdict is None:
            return None
        by_rank = {w.local_rank: w for w in workers}
        stuck, waiting = [by_rank[r] for r in verdict[0]], [by_rank[r] for r in verdict[1]]
        limit = self.timeout_s + (OTHER_NODE_GRACE_S if not stuck and self.nnodes > 1 else 0)
        if quiet < limit:
            return None
        waits = {w.global_rank: records[w.local_rank] for w in waiting}
        failures = [
            self._stuck(w, records[w.local_rank], waits, quiet, node_rank, host) for w in stuck
        ]
        failures += [_waiter(w, records[w.local_rank], quiet, node_rank, host) for w in waiting]
        message = self._message(stuck, records, waits, quiet)
        return Stall(failures, message, tuple(w.local_rank for w in stuck))

    def _progress(self, worker: Worker) -> Path:
        return progress.path_for(self.directory, worker.local_rank)

    def _stuck(
        self,
        worker: Worker,
        record: Record | None,
        waits: dict[int, Record | None],
        quiet: float,
        node_rank: int,
        host: str,
    ) -> WorkerFailure:
        where = _where(record)
        frozen = _frozen(worker)
        if frozen:
            stack = [f"(no stack: a stopped process cannot write one; {frozen})"]
            advice = _frozen_advice(worker.global_rank, where, waits)
        else:
            stack = self._dump(worker)
            advice = _advice(worker.global_rank, record, waits)
        return WorkerFailure(
            rank=worker.global_rank,
            local_rank=worker.local_rank,
            node_rank=node_rank,
            host=host,
            pid=worker.id or 0,
            how=f"stalled: no progress for {quiet:.0f} s (--stall-timeout {self.timeout_s:g})",
            message=f"{'is frozen' if frozen else 'made no progress'}, last {where}",
            traceback=[*stack, advice],
            detected=time.time(),
        )

    def _dump(self, worker: Worker) -> list[str]:
        """The worker's Python stack, as faulthandler writes it on DUMP_SIGNAL."""
        path = stack_path(self.directory, worker.local_rank)
        if not worker.id:
            return ["(no stack: the worker's pid is unknown)"]
        text = request_stack(worker.id, path)
        if text is None:
            return ["(no stack: the worker has exited)"]
        lines = _current_thread_first(text)
        if not lines:
            return ["(no stack: the worker wrote none; was it started by lockstep's bootstrap?)"]
        head = ["Python stack of every thread when the stall was detected (faulthandler):"]
        return head + lines[:STACK_LINES] + (["..."] if len(lines) > STACK_LINES else [])

    def _message(
        self,
        stuck: list[Worker],
        records: dict[int, Record | None],
        waits: dict[int, Record | None],
        quiet: float,
    ) -> str:
        waiting = "; ".join(f"rank {r} {rec.describe()}" for r, rec in waits.items() if rec)
        if not stuck and self.nnodes > 1:
            return (
                f"no progress for {quiet:.0f} s on this node and every local rank waits in a "
                f"collective ({waiting}): the stuck rank is on another node; see its log."
            )
        if not stuck:
            return (
                f"no progress for {quiet:.0f} s and every rank waits in a collective, none of "
                f"them stopped ({waiting}): they wait on collectives that do not match (a "
                "rank-only branch, uneven data) or on a transport that hangs; each rank's log "
                "says what it waits on, and py-spy dump shows where each one is."
            )
        names = ", ".join(
            f"rank {w.global_rank} ({'frozen, ' if _frozen(w) else ''}"
            f"last {_where(records[w.local_rank])})"
            for w in stuck
        )
        return f"stalled: no progress for {quiet:.0f} s. Stuck: {names}. Waiting: {waiting}."


def _current_thread_first(dump: str) -> list[str]:
    """faulthandler's dump, the thread that took the signal (the main one) first."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        if line.strip() and blocks:
            blocks[-1].append(line)
    blocks.sort(key=lambda block: not block[0].startswith("Current thread"))
    return [line for block in blocks for line in block]


def process_state(pid: int) -> str | None:
    """The state letter of `pid` in /proc/<pid>/stat (R, S, D, T...); None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after the command, which may hold spaces
    return fields[0] if fields else None


def _frozen(worker: Worker) -> str:
    """'/proc/<pid>/stat says T (stopped)' when the worker is stopped, else ''."""
    state = process_state(worker.id) if worker.id else None
    if state not in FROZEN_STATES:
        return ""
    return f"/proc/{worker.id}/stat says state {state} (stopped)"


def _frozen_advice(rank: int, where: str, waits: dict[int, Record | None]) -> str:
    waiting = ", ".join(f"rank {r} {rec.describe()}" for r, rec in waits.items() if rec)
    return (
        f"rank {rank} is frozen ({where}): its process is stopped, not running, while the "
        f"others waited for it: {waiting}. What to do: find what stopped it (a SIGSTOP, a "
        "Ctrl-Z in its terminal, a debugger attached, the node's cgroup freezer or a "
        "suspended VM); `kill -CONT <pid>` resumes a process stopped by a signal."
    )


def _is_waiting(record: Record | None) -> bool:
    return record is not None and record.phase.waits


def _where(record: Record | None) -> str:
    return record.describe() if record else "starting (no synchronised step yet)"


def _waiter(
    worker: Worker, record: Record | None, quiet: float, node_rank: int, host: str
) -> WorkerFailure:
    return WorkerFailure(
        rank=worker.global_rank,
        local_rank=worker.local_rank,
        node_rank=node_rank,
        host=host,
        pid=worker.id or 0,
        how="stopped by the stall watch",
        message=f"stalled: {_where(record)} for {quiet:.0f} s",
        detected=time.time(),
    )


def _advice(rank: int, record: Record | None, waits: dict[int, Record | None]) -> str:
    """What to do, for where the stuck rank is: a save the others are not in, or elsewhere."""
    waiting = ", ".join(f"rank {r} {rec.describe()}" for r, rec in waits.items() if rec)
    if record is not None and record.phase == Phase.CHECKPOINT:
        cause = (
            "A rank that saves while the others still train left the training loop early "
            "(it ran out of data): give every rank the same number of batches "
            "(lockstep.shard) or use Join."
        )
    else:
        cause = (
            "A rank blocked in I/O, a lock, its data loader or a rank-only branch needs that fixed."
        )
    return (
        f"rank {rank} stopped making progress ({_where(record)}) while the others waited "
        f"for it: {waiting}. What to do: the stack above shows where rank {rank} is. "
        f"{cause} Raise --stall-timeout if a rank legitimately works alone longer "
        "(evaluation)."
    )
