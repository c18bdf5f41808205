"""`lockstep run --trace DIR`: every worker traces, and this node reports when they end.

Before the workers start, `prepare` exports LOCKSTEP_TRACE=DIR (the workers
inherit it, so the engine writes DIR/trace_rank<R>.json with no change to the
script) and removes this node's rank files left by an earlier run. After they
end, whatever the outcome, `report` merges this node's ranks, draws the
timeline and prints the straggler line (`lockstep.observe.report`). With several
nodes each writes `trace_node<K>.json`; `lockstep trace merge` joins the nodes.
"""

from __future__ import annotations

import os
from pathlib import Path

from lockstep.env import TRACE_VARIABLE
from lockstep.launch.cli.config import RunConfig
from lockstep.observe.report import report_trace
from lockstep.observe.trace import rank_file


def node_ranks(cfg: RunConfig) -> list[int]:
    """The global ranks of this node's workers."""
    first = cfg.node_rank * cfg.nproc_per_node
    return list(range(first, first + cfg.nproc_per_node))


def prepare(cfg: RunConfig) -> None:
    """Export LOCKSTEP_TRACE for the workers; clear this node's stale rank files."""
    if cfg.trace_dir is None:
        return
    directory = Path(cfg.trace_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[TRACE_VARIABLE] = str(directory)
    for rank in node_ranks(cfg):
        rank_file(directory, rank).unlink(missing_ok=True)


def report(cfg: RunConfig) -> None:
    """Merge, draw and compare this node's traces; print what was written (stdout)."""
    if cfg.trace_dir is None:
        return
    directory = Path(cfg.trace_dir).resolve()
    suffix = "" if cfg.nnodes == 1 else f"_node{cfg.node_rank}"
    try:
        lines, merged = report_trace(directory, node_ranks(cfg), suffix)
    except ValueError as error:  # a file cut short by a full disk, say
        lines, merged = [f"trace: not merged: {error}"], False
    if merged and cfg.nnodes > 1:
        lines.append(
            "trace: this node's ranks only; join the nodes with `lockstep trace merge "
            "DIR_NODE0 DIR_NODE1 ... -o all.json` (each node's trace directory, copied here)"
        )
    print("\n".join(f"lockstep run [node {cfg.node_rank}]: {line}" for line in lines), flush=True)
