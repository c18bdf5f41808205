"""A process that already imported, becoming a worker: the launcher's side of the handover.

When `LiveReplacer` replaces a lost worker, `start_worker` picks who takes the rank,
in this order: an idle spare (`spares.py`, `--spares K`), a child of the node's fork
server (`forks.py`), else a new process as torch's agent starts one. The first two
are given the same `assignment` (what torch's agent would give a new process) and
become the worker in `standby.run_as_worker`; their handle (`ReadyHandler`) takes the
worker's place in torch's process context, which then treats it as any worker (exit
codes, stop, restart).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Protocol

from torch.distributed.elastic.multiprocessing.subprocess_handler import (
    SubprocessHandler,
    get_subprocess_handler,
)

log = logging.getLogger("lockstep.run")
BOOTSTRAP = (
    "-u",
    "-m",
    "lockstep.launch.supervise.bootstrap",
)  # how torch's agent starts our workers


class ReadyHandler(SubprocessHandler):
    """torch's handle on a worker whose process runs already (a spare, a fork server's child).

    Args:
        proc: the process: a `subprocess.Popen`, or anything with its `pid`, `returncode`,
            `poll`, `wait` and `kill` (`forks.ForkedProcess`).
        local_rank: the worker's local rank.
    """

    def __init__(self, proc: Any, local_rank: int) -> None:  # no super: nothing to start
        self.proc = proc
        self.local_rank_id = local_rank
        self._stdout = None  # the process opened its own output files
        self._stderr = None


class Taker(Protocol):
    """Something that turns a ready process into the worker of `local_rank`, or says why not."""

    def assign(self, local_rank: int, assignment: dict[str, Any]) -> ReadyHandler | str: ...


def assignment(pcontext: Any, local_rank: int, env: dict[str, str]) -> dict[str, Any] | None:
    """What a ready process needs to become the worker; None when the worker is not ours.

    Args:
        pcontext: torch's process context of the workers (a SubprocessContext).
        local_rank: the worker's local rank.
        env: the variables torch's agent gives this worker, with the new generation.

    Returns:
        The worker's environment (the launcher's plus `env`, as torch's handler builds
        it), its bootstrap arguments and its output files; None when the workers do not
        run this interpreter and lockstep's bootstrap (then only a new process will do).
    """
    args = [str(arg) for arg in pcontext.args[local_rank]]
    if pcontext.entrypoint != sys.executable or tuple(args[: len(BOOTSTRAP)]) != BOOTSTRAP:
        return None
    return {
        "env": {**os.environ, **env},
        "args": args,
        "stdout": pcontext.stdouts.get(local_rank) or "",
        "stderr": pcontext.stderrs.get(local_rank) or "",
    }


def start_worker(
    takers: list[Taker], pcontext: Any, local_rank: int, env: dict[str, str]
) -> SubprocessHandler:
    """The new worker of `local_rank`: the first taker that accepts, else a new process.

    Args:
        takers: this node's spares, then its fork server; when none takes the rank,
            one line says why.
        pcontext: torch's process context of the workers (a SubprocessContext).
        local_rank: the worker's local rank.
        env: the variables torch's agent gives this worker, with the new generation.
    """
    given = assignment(pcontext, local_rank, env) if takers else None
    reasons = [] if given is not None else ["the workers do not run lockstep's bootstrap"]
    for taker in takers if given is not None else []:
        taken = taker.assign(local_rank, given)
        if not isinstance(taken, str):
            return taken
        reasons.append(taken)
    if takers:
        log.warning(
            "local rank %d: %s; a new process takes it (it imports torch first)",
            local_rank,
            "; ".join(reasons),
        )
    return get_subprocess_handler(
        entrypoint=pcontext.entrypoint,
        args=pcontext.args[local_rank],
        env=env,
        stdout=pcontext.stdouts.get(local_rank),
        stderr=pcontext.stderrs.get(local_rank),
        local_rank_id=local_rank,
    )
