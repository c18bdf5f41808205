"""The end of a traced run: merge the ranks' traces, draw the timeline, name the straggler.

`lockstep run --trace DIR` calls `report_trace` when its workers have ended
(success or failure). It works from the trace files alone, so it needs no
process group: `trace_stragglers` rebuilds, for every rank and step, when each
bucket became ready and when the step's last all-reduce ended (both from the
rank's own forward start), and hands them to `straggler.analyze`, the same
comparison the Monitor's live report makes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lockstep.observe.plot import plot_timeline
from lockstep.observe.straggler import StragglerReport, analyze
from lockstep.observe.trace import load_events, merge_traces, rank_file

TIMELINE_STEPS = 3


def _step_rows(events: list[dict[str, Any]]) -> dict[int, dict[int, tuple]]:
    """rank -> step -> (layout, ready times, end), seconds from the rank's forward start."""
    parts: dict[tuple[int, int], dict[str, Any]] = defaultdict(lambda: {"ready": {}, "done": {}})
    for e in events:
        args, cat = e.get("args", {}), e.get("cat")
        if "step" not in args or cat not in ("forward", "ready", "allreduce"):
            continue
        part = parts[(int(e["pid"]), int(args["step"]))]
        if cat == "forward":
            part["start"] = e["ts"]
        elif cat == "ready":
            part["ready"][args["bucket"]] = (e["ts"], args["bytes"])
        else:
            part["done"][args["bucket"]] = e["ts"] + e["dur"]
    rows: dict[int, dict[int, tuple]] = defaultdict(dict)
    for (rank, step), part in parts.items():
        buckets = sorted(part["ready"])
        if "start" not in part or not buckets or buckets != sorted(part["done"]):
            continue
        start = part["start"]
        layout = tuple(part["ready"][b][1] for b in buckets)
        ready = [(part["ready"][b][0] - start) / 1e6 for b in buckets]
        end = (max(part["done"].values()) - start) / 1e6
        rows[rank][step] = (layout, ready, end)
    return rows


def trace_stragglers(events: list[dict[str, Any]]) -> StragglerReport | None:
    """The straggler report of the steps every rank traced with the last bucket layout.

    Returns:
        The report; None with fewer than two ranks or no step common to all of them.
    """
    rows = _step_rows(events)
    if len(rows) < 2:
        return None
    common = sorted(set.intersection(*(set(steps) for steps in rows.values())))
    if not common:
        return None
    layout = rows[min(rows)][common[-1]][0]
    steps = [s for s in common if all(rows[r][s][0] == layout for r in rows)]
    if not steps:  # the ranks disagree on the layout: nothing to compare bucket by bucket
        return None
    ranks = sorted(rows)
    ready = torch.tensor([[rows[r][s][1] for s in steps] for r in ranks], dtype=torch.float64)
    end = torch.tensor([[rows[r][s][2] for s in steps] for r in ranks], dtype=torch.float64)
    report = analyze(ready, end, steps[0], steps[-1])
    # analyze counts ranks from 0; the trace's ranks may be one node's (8-15, say).
    return StragglerReport(**{**report.__dict__, "rank": ranks[report.rank]})


def report_trace(
    directory: str | Path, ranks: Sequence[int], suffix: str = ""
) -> tuple[list[str], bool]:
    """Merge `ranks`' files in `directory`, draw the last steps, compare the ranks.

    Args:
        directory: the trace directory the workers wrote.
        ranks: the ranks whose files to merge (one node's, for a multi-node run).
        suffix: added to the output names (`trace{suffix}.json`, `timeline{suffix}.png`).

    Returns:
        The lines to print, and whether a merged trace was written.
    """
    directory = Path(directory)
    present = [r for r in ranks if rank_file(directory, r).exists()]
    missing = sorted(set(ranks) - set(present))
    lines = []
    if missing:
        lines.append(f"trace: no file from rank(s) {missing} (they ended before their first write)")
    if not present:
        return [*lines, f"trace: nothing to merge in {directory}"], False
    merged = merge_traces(directory, directory / f"trace{suffix}.json", ranks=present)
    lines.append(f"trace: {merged} (open it in https://ui.perfetto.dev)")
    events = load_events(merged)
    try:
        png = plot_timeline(merged, directory / f"timeline{suffix}.png", TIMELINE_STEPS)
        lines.append(f"timeline: {png}")
    except ValueError as error:
        lines.append(f"timeline: not drawn: {error}")
    report = trace_stragglers(events)
    if report is not None:
        lines.append(report.describe())
    return lines, True
