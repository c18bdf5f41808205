"""`lockstep trace`: merge the ranks' Chrome traces into one file, or draw a few steps.

    lockstep trace merge runs/demo/trace -o runs/demo/trace.json
    lockstep trace merge node0/trace node1/trace -o all.json     # join nodes' directories
    lockstep trace plot runs/demo/trace.json -o runs/demo/timeline.png --steps 3

A missing or unreadable trace is bad input: one line, exit code 2 (see lockstep.cli).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.observe.plot import plot_timeline
from lockstep.observe.trace import MERGED_NAME, join_traces, merge_traces


def add_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser(
        "trace",
        help="merge per-rank Chrome traces, or draw a timeline PNG",
        description="Work with the trace_rank<N>.json files that LOCKSTEP_TRACE=<dir> or "
        "lockstep.Monitor(trace=<dir>) writes; open the JSON in Perfetto or chrome://tracing.",
    )
    actions = trace.add_subparsers(dest="action", required=True)
    merge = actions.add_parser("merge", help="merge every rank's trace into one file")
    merge.add_argument(
        "directory", nargs="+", help="directory holding trace_rank<N>.json (one per node)"
    )
    merge.add_argument(
        "-o", "--output", default=None, help="merged file (default FIRST_DIR/trace.json)"
    )
    merge.set_defaults(handler=_merge)
    plot = actions.add_parser("plot", help="draw a few steps, one lane per rank, as a PNG")
    plot.add_argument("source", help="a merged trace file, or a directory of rank files")
    plot.add_argument("-o", "--output", required=True, help="the PNG to write")
    plot.add_argument("--steps", type=int, default=3, help="how many last steps (default 3)")
    plot.set_defaults(handler=_plot)


def _merge(ns: argparse.Namespace) -> int:
    first = ns.directory[0]
    if len(ns.directory) == 1:
        merged = merge_traces(first, ns.output)
    else:
        merged = join_traces(ns.directory, ns.output or Path(first) / MERGED_NAME)
    print(f"merged trace: {merged}")
    return 0


def _plot(ns: argparse.Namespace) -> int:
    print(f"timeline: {plot_timeline(ns.source, ns.output, ns.steps)}")
    return 0
