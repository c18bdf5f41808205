"""Turn torch.distributed.elastic's failure record into one short, readable summary.

The summary names the failed rank and node, its exit code or signal, the
exception, and the last lines of the worker's own traceback (recorded by
`lockstep.launch.bootstrap`), instead of a page of launcher internals.
"""

from __future__ import annotations

import socket

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

TRACEBACK_LINES = 12


def _traceback_tail(failure: ProcessFailure, lines: int) -> list[str]:
    data = failure.error_file_data or {}
    message = data.get("message", {})
    if not isinstance(message, dict):
        return []
    stack = message.get("extraInfo", {}).get("py_callstack", "")
    tail = [line for line in stack.rstrip().splitlines() if line.strip()]
    return tail[-lines:]


def _exit_reason(failure: ProcessFailure) -> str:
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exit code {failure.exitcode}"


def describe_failure(
    rank: int, failure: ProcessFailure, node_rank: int, lines: int = TRACEBACK_LINES
) -> str:
    """A few lines about one failed worker."""
    head = (
        f"rank {rank} (local rank {failure.local_rank}, node {node_rank} "
        f"[{socket.gethostname()}], pid {failure.pid}): {_exit_reason(failure)}"
    )
    tail = _traceback_tail(failure, lines)
    if not tail:
        return head + "\n    (no Python traceback: the process died without raising)"
    return head + "\n" + "\n".join("    " + line for line in tail)


def summarize(error: ChildFailedError, node_rank: int) -> str:
    """The summary printed by `lockstep run` when workers fail, first failure first."""
    failures = sorted(error.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    first_rank, first = failures[0]
    parts = [
        f"lockstep run: {len(failures)} worker(s) failed on node {node_rank}; first failure:",
        "  " + describe_failure(first_rank, first, node_rank).replace("\n", "\n  "),
    ]
    others = [f"rank {r} ({_exit_reason(f)})" for r, f in failures[1:]]
    if others:
        parts.append("  other workers: " + ", ".join(others))
    return "\n".join(parts)
