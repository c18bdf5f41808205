"""What every node tells the others through the rendezvous store when its workers stop.

torch.distributed.elastic restarts one node's workers when they fail, but the
other nodes learn of it only if their own workers happen to fail too. Here each
node's launcher posts a `NodeReport` under the current rendezvous round whenever
it stops its workers (its own failed, a peer's report arrived, a peer went
silent, or the launcher got a signal), and watches for the others' reports. A
report marks the round as failed for every node, so all of them restart
together, and all of them can print the same summary of what went wrong first.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.launch.rendezvous.rounds import LockstepRendezvous

REPORT_KEY = "report/{node}"  # keys within the current rendezvous round
LEFT_KEY = "left/{node}"
DONE_KEY = "done/{node}"  # a node whose workers all succeeded
LEFT_EARLY = "exit code 0"
EARLY_MESSAGE = (
    "its script ended (sys.exit(0), or a return) while other ranks were still running: "
    "they then lose it in their next collective"
)
ALIVE_KEY = "alive/{node}"  # a node's heartbeat, a sealed growing count
# Messages that mean "a peer went away", the echo of a failure rather than its cause.
_ECHO = re.compile(
    r"connection (reset|closed|refused)|broken pipe|connectfullmesh|socket timeout|"
    r"timed out|dist(network|backend)error|communicator was aborted|peer|stalled: waiting",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended badly, in words that fit a summary."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    how: str  # "exit code 1" or "killed by signal SIGKILL"
    message: str  # the exception line, or "" when the process died without raising
    traceback: list[str] = field(default_factory=list)
    detected: float = 0.0  # wall-clock time the launcher saw it

    @property
    def left_early(self) -> bool:
        """True for a worker whose script ended well while the round failed around it."""
        return self.how == LEFT_EARLY

    @property
    def is_echo(self) -> bool:
        """True when this failure looks caused by another one (a dropped connection, a stop)."""
        if "SIGTERM" in self.how or "SIGINT" in self.how:
            return True
        if self.left_early:
            return False
        return bool(_ECHO.search(self.message))


@dataclass(frozen=True)
class NodeReport:
    """One node's account of why it stopped its workers in this round.

    Attributes:
        node_rank: the reporting node.
        host: its host name.
        addr: its address towards the master.
        cause: one line: "workers failed", "rank 3 on node 1 failed", "stopped by SIGTERM", ...
        failures: its own failed workers, if any.
        final: True when the node will not rejoin (it was stopped): nobody should restart.
    """

    node_rank: int
    host: str
    addr: str
    cause: str
    failures: list[WorkerFailure] = field(default_factory=list)
    final: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> NodeReport | None:
        """The report from its `asdict` form; None when the fields do not match."""
        try:
            failures = [WorkerFailure(**item) for item in data["failures"]]
            return cls(**{**data, "failures": failures})
        except (TypeError, KeyError):
            return None


def post(board: LockstepRendezvous, report: NodeReport) -> None:
    """Publish this node's report, sealed, for the current round."""
    board.put(REPORT_KEY.format(node=report.node_rank), asdict(report))


def read_reports(board: LockstepRendezvous, nnodes: int) -> dict[int, NodeReport]:
    """The reports posted so far and sealed with the job's secret, by node rank."""
    found = {}
    for node in range(nnodes):
        data = board.take(REPORT_KEY.format(node=node))
        report = NodeReport.from_dict(data) if isinstance(data, dict) else None
        if report is not None and report.node_rank == node:
            found[node] = report
    return found


def gather(board: LockstepRendezvous, nnodes: int, grace_s: float) -> dict[int, NodeReport]:
    """Wait up to `grace_s` for every node's report; return those that came."""
    deadline = time.monotonic() + grace_s
    while True:
        found = read_reports(board, nnodes)
        if len(found) == nnodes or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def first_failure(reports: dict[int, NodeReport]) -> WorkerFailure | None:
    """The failure most likely to be the cause: a real error, else a rank that left early
    (its peers' errors are echoes of it), else the earliest echo."""
    failures = [f for report in reports.values() for f in report.failures]
    if not failures:
        return None
    return min(failures, key=lambda f: (f.is_echo, f.left_early, f.detected, f.rank))


def all_done(board: LockstepRendezvous, nnodes: int) -> bool:
    """Whether every node posted that its workers all succeeded in this round."""
    return all(board.take(DONE_KEY.format(node=node)) is True for node in range(nnodes))


def leave(board: LockstepRendezvous, expected: int, wait_s: float) -> None:
    """Count this node out of the job; wait up to `wait_s` for `expected` nodes to be out.

    Node 0 hosts the store in its launcher, so it waits before exiting: the others
    may still be reading reports from it.
    """
    board.put(LEFT_KEY.format(node=board.me.node_rank), True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        nodes = range(board.nnodes)
        if sum(board.take(LEFT_KEY.format(node=node)) is True for node in nodes) >= expected:
            return
        time.sleep(0.05)
