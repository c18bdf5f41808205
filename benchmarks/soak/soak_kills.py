"""The soak's faults: which kills, in which order, how each is delivered and when it is over.

Kinds (each kill picks its victim at random where the kind leaves a choice):
- "save": rank 0 held inside a checkpoint write (temporary file written, not committed);
- "allreduce": a rank held inside backward while its peers wait in the all-reduce;
- "rank 0": rank 0 SIGKILLed at a random moment;
- "worker": a random rank SIGKILLed at a random moment;
- "lost node": every process of node 1 (launcher and workers) SIGKILLed, then
  `lockstep run --node-rank 1` started again 3 s later (`rejoin`).
A kill is over when every victim rank's new process has completed a step; it was
recovered live when no other rank's process changed (else the group restarted).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from soak_nodes import Job, read_pids

WORLD_SIZE = 4


def kill_plan(kills: int, rng: random.Random) -> list[str]:
    """`kills` worker kills (a quarter in a save, a quarter mid-all-reduce, one of rank 0,
    the rest random), shuffled, with one lost node among the middle ones."""
    quarter = max(1, kills // 4)
    plan = ["save"] * quarter + ["allreduce"] * quarter + ["rank 0"]
    plan = plan[:kills] + ["worker"] * max(0, kills - len(plan))
    rng.shuffle(plan)
    plan.insert(rng.randrange(kills // 4, kills - kills // 4 + 1), "lost node")
    return plan


def wait_until(what: str, check, timeout: float, job: Job) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or job.ended():
            raise RuntimeError(f"timed out or job ended waiting for {what}:\n{job.tail()}")
        time.sleep(0.05)


def _held(job: Job, flag: str, held: str, content: str) -> int:
    """Raise `flag` (with `content`) and wait until a worker holds; its pid."""
    out = job.out
    (out / held).unlink(missing_ok=True)
    (out / flag).write_text(content)
    wait_until(f"a worker holding after {flag}", (out / held).exists, 60, job)
    return int((out / held).read_text())


def rejoin(job: Job, lost: dict[int, int], after_s: float = 3.0, tries: int = 3) -> None:
    """Start node 1 again `after_s` after its loss; again if it stops at once.

    A launcher that comes back before the survivors noticed the loss finds its dead
    predecessor registered in the current rendezvous round and stops ("two nodes were
    started with --node-rank 1"). It came back once node 1's ranks run new processes
    (`lost`: their pids before the loss), or when it still runs 20 s after its start.
    """
    for _ in range(tries):
        time.sleep(after_s)
        job.start_node(1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and job.procs[1].poll() is None:
            pids = read_pids(job.out)
            if all(pids.get(rank, lost.get(rank)) != lost.get(rank) for rank in (2, 3)):
                return
            time.sleep(0.1)
        if job.procs[1].poll() in (None, 0):
            return


def deliver(kind: str, job: Job, rng: random.Random) -> tuple[str, list[int], float]:
    """Deliver one kill: (what was killed, the victim ranks, the kill's time)."""
    if kind == "lost node":
        lost = read_pids(job.out)
        killed_at = job.kill_node(1)
        rejoin(job, lost)
        return "node 1, every process (then started again)", [2, 3], killed_at
    if kind == "save":
        pid, rank, what = _held(job, "pause_in_save", "in_save", ""), 0, "rank 0 in a write"
    elif kind == "allreduce":
        rank = rng.randrange(WORLD_SIZE)
        pid = _held(job, "pause_in_backward", "in_backward", str(rank))
        what = f"rank {rank} mid-all-reduce"
    else:
        rank = 0 if kind == "rank 0" else rng.randrange(WORLD_SIZE)
        pid, what = read_pids(job.out)[rank], f"rank {rank}"
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return what, [rank], killed_at


def first_step_after(out: Path, rank: int, old_pid: int | None, killed_at: float) -> float | None:
    """When a new process of `rank` (not `old_pid`) first completed a step after the kill."""
    try:
        lines = (out / "steps" / str(rank)).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 3 and int(fields[0]) != old_pid and float(fields[2]) > killed_at:
            return float(fields[2])
    return None


def recovered_at(out: Path, old: dict[int, int], victims: list[int], killed_at: float):
    """When every victim rank's new process had completed a step after the kill, or None."""
    times = [first_step_after(out, rank, old.get(rank), killed_at) for rank in victims]
    return None if None in times else max(times)


def wait_recovery(job: Job, old: dict[int, int], victims: list[int], killed_at: float, what: str):
    """Seconds from the kill to the step that ended the recovery (see `recovered_at`)."""
    deadline = time.monotonic() + 400
    while (done := recovered_at(job.out, old, victims, killed_at)) is None:
        if time.monotonic() > deadline or job.ended():
            raise RuntimeError(f"timed out or job ended waiting for {what}:\n{job.tail()}")
        time.sleep(0.05)
    return done - killed_at
