"""torchrun's error files: what its failure summary prints, and which rank it calls the root cause.

torchrun (torch.distributed.elastic) gives each worker a file, TORCHELASTIC_ERROR_FILE
(`<log_dir>/<run>/attempt_<n>/<local_rank>/error.json`). When a worker fails it
reads every failed worker's file, and its summary's "Root Cause (first observed
failure)" is the failure with the smallest timestamp: the file's `timestamp`, or,
for a worker that left none (a rank killed by torchrun's own SIGTERM), the moment
torchrun looked, after it stopped the others (`ProcessFailure`, `ChildFailedError.
get_first_failure`, torch 2.13). A rank whose stall bound ends the run
(`runtime/waits.py`) exits first, so torchrun named it, the one rank that only
waited, as the root cause.

So that rank also writes the file of each stuck rank on its own node, whose path
differs only in the local rank, unless that rank wrote one itself: the stuck rank's
failure then carries the time the wait began (earlier than the waiting rank's) and
the message naming it, and torchrun names it as the root cause. A stuck rank on
another node has its file on that node: there the waiting rank's own message, which
names the stuck rank first, is what torchrun shows under the header.
"""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.env import read_variable

VARIABLE = "TORCHELASTIC_ERROR_FILE"
NAME = "error.json"


def write_own(message: str, timestamp: int) -> None:
    """This rank's failure as torchrun prints it (no-op outside torch elastic)."""
    path = read_variable(VARIABLE)
    if path:
        with open(path, "w") as fp:
            json.dump({"message": message, "timestamp": timestamp}, fp)


def peer_path(rank: int) -> Path | None:
    """The error file torchrun gave global rank `rank`, when it runs on this node; else None.

    torchrun numbers a node's ranks contiguously (node_rank * local_world_size +
    local_rank, the nodes alike), and its files differ only in the local rank's folder.
    """
    own = read_variable(VARIABLE)
    try:
        me, local = int(read_variable("RANK") or ""), int(read_variable("LOCAL_RANK") or "")
        per_node = int(read_variable("LOCAL_WORLD_SIZE") or "")
    except ValueError:
        return None
    if not own or per_node <= 0 or me // per_node != rank // per_node:
        return None
    path = Path(own)
    if path.name != NAME or path.parent.name != str(local):
        return None  # not torchrun's layout: leave it alone
    peer = path.parent.parent / str(rank % per_node) / NAME
    return peer if peer.parent.is_dir() else None


def name_stuck(rank: int, message: str, timestamp: int) -> bool:
    """Write stuck `rank`'s file (on this node, when it wrote none): True when written."""
    path = peer_path(rank)
    if path is None:
        return False
    try:
        with open(path, "x") as fp:  # never over the rank's own account of its failure
            json.dump({"message": message, "timestamp": timestamp}, fp)
    except OSError:
        return False
    return True
