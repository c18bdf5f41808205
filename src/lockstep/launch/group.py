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

import json
import re
import time
from dataclasses import asdict, dataclass, field

from torch.distributed import Store

REPORT_KEY = "lockstep/report/{node}"
COUNT_KEY = "lockstep/reports"
LEFT_KEY = "lockstep/left"
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
    def is_echo(self) -> bool:
        """True when this failure looks caused by another one (a dropped connection, a stop)."""
        if "SIGTERM" in self.how or "SIGINT" in self.how:
            return True
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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeReport:
        data = json.loads(text)
        data["failures"] = [WorkerFailure(**item) for item in data["failures"]]
        return cls(**data)


def post(store: Store, report: NodeReport) -> None:
    """Publish this node's report for the current round and bump the round's report count."""
    store.set(REPORT_KEY.format(node=report.node_rank), report.to_json())
    store.add(COUNT_KEY, 1)


def reports_posted(store: Store) -> int:
    """How many nodes have reported in this round (0 while all is well); never blocks."""
    return int(store.add(COUNT_KEY, 0))


def read_reports(store: Store, nnodes: int) -> dict[int, NodeReport]:
    """The reports posted so far, by node rank; never blocks."""
    found = {}
    for node in range(nnodes):
        key = REPORT_KEY.format(node=node)
        if store.check([key]):
            found[node] = NodeReport.from_json(store.get(key))
    return found


def gather(store: Store, nnodes: int, grace_s: float) -> dict[int, NodeReport]:
    """Wait up to `grace_s` for every node's report; return those that came."""
    deadline = time.monotonic() + grace_s
    while True:
        found = read_reports(store, nnodes)
        if len(found) == nnodes or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def first_failure(reports: dict[int, NodeReport]) -> WorkerFailure | None:
    """The failure most likely to be the cause: a real error before its echoes, then earliest."""
    failures = [f for report in reports.values() for f in report.failures]
    if not failures:
        return None
    return min(failures, key=lambda f: (f.is_echo, f.detected, f.rank))


def leave(store: Store, nnodes: int, wait_s: float) -> None:
    """Count this node out of the job; wait up to `wait_s` for every node to be out.

    Node 0 hosts the store in its launcher, so it waits before exiting: the others
    may still be reading reports from it.
    """
    left = int(store.add(LEFT_KEY, 1))
    deadline = time.monotonic() + wait_s
    while left < nnodes and time.monotonic() < deadline:
        time.sleep(0.05)
        left = int(store.add(LEFT_KEY, 0))
