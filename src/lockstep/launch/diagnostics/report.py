"""Short, readable failure reports: which rank on which node, how it ended, its own traceback.

`describe` turns torch.distributed.elastic's `ProcessFailure` (exit code, and the
error file that `lockstep.launch.supervise.bootstrap` writes) into a `WorkerFailure`.
`summarize` renders the reports every node gathered into the few lines the
launcher prints on every node when training fails; `restart_line` is the one line
logged for each restart.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import lockstep
from lockstep.launch.supervise.group import NodeReport, WorkerFailure, first_failure

TRACEBACK_LINES = 12
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")
MESSAGE_CHARS = 200
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_C10D = "torch/distributed/distributed_c10d.py"
_TORCH, _LOCKSTEP = (str(Path(module.__file__).parent) + os.sep for module in (torch, lockstep))


def _stack(error_file_data: dict | None) -> str:
    """The Python traceback the worker bootstrap (`launch/supervise/bootstrap.py`) recorded."""
    message = (error_file_data or {}).get("message", {})
    return message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""


def _traceback(failure: ProcessFailure) -> list[str]:
    stack = _stack(failure.error_file_data)
    return [line for line in stack.rstrip().splitlines() if line.strip()]


def scripts_collective(error_file_data: dict | None) -> str:
    """'torch.distributed.all_gather, called at train.py:85 (count_ids)' when the recorded
    traceback ends in a collective that the script called itself (not through lockstep),
    else ''. Live recovery does not run such a collective again (docs/multinode.md)."""
    frames = _FRAME.findall(_stack(error_file_data))
    inside = [i for i, (path, _, _) in enumerate(frames) if path.endswith(_C10D)]
    if not inside:
        return ""
    callers = [frame for frame in frames[: inside[0]] if not frame[0].startswith(_TORCH)]
    if not callers or callers[-1][0].startswith(_LOCKSTEP):  # lockstep's own collective
        return ""
    path, line, function = callers[-1]
    where = f"{path.rsplit('/', 1)[-1]}:{line} ({function})"
    return f"torch.distributed.{frames[inside[-1]][2]}, called at {where}"


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exit code {failure.exitcode}"


def _short(message: str) -> str:
    """The exception line without C++ source locations such as '[/src/gloo/pair.cc:537] '."""
    return _SOURCE_LOCATION.sub("", message)


def describe(rank: int, failure: ProcessFailure, node_rank: int, host: str) -> WorkerFailure:
    """A `WorkerFailure` for global rank `rank` from elastic's record of it."""
    stack = _traceback(failure)
    return WorkerFailure(
        rank=rank,
        local_rank=failure.local_rank,
        node_rank=node_rank,
        host=host,
        pid=failure.pid,
        how=_how(failure),
        message=_short(stack[-1]) if stack else "",
        traceback=stack[-TRACEBACK_LINES:],
        detected=time.time(),
    )


def where(failure: WorkerFailure) -> str:
    """'rank 3 (node 1, vm, local rank 1, pid 42)'."""
    return (
        f"rank {failure.rank} (node {failure.node_rank}, {failure.host}, "
        f"local rank {failure.local_rank}, pid {failure.pid})"
    )


def one_line(failure: WorkerFailure) -> str:
    """'rank 3 (node 1, ...): killed by signal SIGKILL' or '...: exit code 1: ValueError: x'."""
    message = failure.message
    if len(message) > MESSAGE_CHARS:
        message = message[: MESSAGE_CHARS - 3] + "..."
    tail = f": {message}" if message else ""
    return f"{where(failure)}: {failure.how}{tail}"


def _silent(reports: dict[int, NodeReport], nnodes: int) -> str:
    missing = [str(node) for node in range(nnodes) if node not in reports]
    if not missing:
        return ""
    return f"node {', '.join(missing)} sent no report (its launcher died or is unreachable); "


def cause_line(reports: dict[int, NodeReport], nnodes: int) -> str:
    """One line naming what went wrong first in this round."""
    first = first_failure(reports)
    if first is not None:
        silent = _silent(reports, nnodes) if first.is_echo else ""
        return silent + ("first error seen: " if silent else "") + one_line(first)
    stopped = [r for r in reports.values() if r.final] or list(reports.values())
    if not stopped:
        return "unknown cause (no node reported)"
    report = min(stopped, key=lambda r: r.node_rank)
    return f"node {report.node_rank} ({report.host}): {report.cause}"


def restart_line(
    reports: dict[int, NodeReport], nnodes: int, restart: int, max_restarts: int
) -> str:
    """The log line for one whole-group restart."""
    return (
        f"restart {restart} of {max_restarts}: {cause_line(reports, nnodes)}; every node "
        "restarts its workers into a fresh rendezvous round"
    )


def _others(reports: dict[int, NodeReport], first: WorkerFailure | None, nnodes: int) -> list[str]:
    lines = []
    for node in range(nnodes):
        report = reports.get(node)
        if report is None:
            lines.append(f"  node {node}: sent no report (its launcher died or is unreachable)")
            continue
        ranks = [f.rank for f in report.failures if f != first]
        detail = f" (also failed: ranks {', '.join(map(str, ranks))})" if ranks else ""
        lines.append(f"  node {node} ({report.host}, {report.addr}): {report.cause}{detail}")
    return lines


def summarize(reports: dict[int, NodeReport], nnodes: int, node_rank: int) -> str:
    """The summary a launcher prints when training fails for good; the same on every node."""
    first = first_failure(reports)
    lines = [f"lockstep run: training failed (this is node {node_rank} of {nnodes})."]
    if first is not None and first.left_early:  # it raised nothing: say what it did
        lines.append(f"  first failure: {one_line(first)}")
    elif first is not None:
        lines.append(f"  first failure: {where(first)}: {first.how}")
        if first.traceback:
            lines += ["      " + line for line in first.traceback]
        else:
            lines.append(
                "      (no Python traceback: the process died without raising; after a "
                "crash in native code, such as SIGABRT or SIGSEGV, the worker's log above "
                "shows each thread's Python stack under 'Fatal Python error')"
            )
    else:
        lines.append(f"  cause: {cause_line(reports, nnodes)}")
    return "\n".join(lines + _others(reports, first, nnodes))
