"""The lines live recovery writes: one format for a recovery, one for a fallback.

A worker that recovered says so on its stderr, in one line:

    lockstep [rank 0]: live recovery: generation 1, rank(s) [1] replaced inside step 3;
    step 3 finished again; 0.21 s standing still

A worker that cannot recover raises `fallback(reason)`, and the launcher logs
`not_possible(reason)`: both end with the same words, so a log search for
"falling back to the whole-group restart" finds every fallback with its reason. A
loss after the peers' scripts ended is no fallback: the job is over, and
`finished(reason)` says it ends failed without a restart.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from lockstep.errors import LockstepError

FALLBACK = "falling back to the whole-group restart"
RESTART = "from the last checkpoint (--max-restarts)"
NO_RESTART_LEFT = (
    "no whole-group restart is left (--max-restarts): the job ends; start every node again "
    "with the same arguments to resume from the last checkpoint"
)


FINISHED = (
    "the job ends failed, with no whole-group restart (that would train the finished job "
    "again from its last checkpoint)"
)


def say(text: str) -> None:
    """'lockstep [rank r]: live recovery: <text>' on this worker's stderr."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"lockstep [rank {rank}]: live recovery: {text}", file=sys.stderr, flush=True)


def recovered(generation: int, replaced: list[int], where: str, then: str, seconds: float) -> None:
    """The line of one recovery: where this rank met the loss, and what it did next."""
    say(
        f"generation {generation}, rank(s) {replaced} replaced {where}; {then}; "
        f"{seconds:.2f} s standing still"
    )


def fallback(reason: str) -> LockstepError:
    """The error of a worker that cannot be recovered live (the launcher restarts the group)."""
    return LockstepError(f"live recovery: {reason}; {FALLBACK}")


def not_possible(reason: str, restarts_left: bool = True) -> str:
    """The launcher's line for a loss it does not recover live."""
    if not restarts_left:
        return f"live recovery not possible: {reason}, and {NO_RESTART_LEFT}"
    return f"live recovery not possible: {reason}; {FALLBACK} {RESTART}"


def miscounted(rank: int, step: int, finished: int) -> str:
    """Why a rank whose script numbers its steps otherwise than the engine is not recoverable.

    Live recovery accepts `save(step)` with `step` the 0-based number of the step just
    finished (one less than the steps finished): a replacement resumes at `step + 1`.
    """
    return (
        f"rank {rank}: the script called Checkpointer.save({step}) after {finished} "
        f"synchronised steps; live recovery accepts save({finished - 1}) here, the 0-based "
        "number of the step just finished (the step a replacement would resume at, "
        f"save's step + 1, would be wrong: {step + 1} instead of {finished}). Number the "
        "steps from 0, as `for step in range(start, steps): ...; ckpt.save(step, ...)` with "
        "`start = restore() + 1` does, or run without --live-recovery"
    )


def ignored(key: str, found: str) -> str:
    """The line for a value in the worker store that does not open (`live/sealed.py`)."""
    return (
        f"ignored what the worker store holds under {key}: {found}; expected a value sealed "
        "with the job's secret for this launch and round. Something other than the job "
        "writes into the worker store: allow its port to the training nodes only "
        "(docs/design/store-security.md)"
    )


def finished(reason: str) -> str:
    """The launcher's line for a loss after the peers' scripts ended (nothing to recover)."""
    return f"live recovery not possible: {reason}; {FINISHED}"
