"""A step profile read from a Chrome trace that a real run recorded (`LOCKSTEP_TRACE=<dir>`).

The trace (observe/trace.py's format) holds, per step and rank, the forward,
backward and optimizer slices and each bucket's `ready` instant with its bytes.
It knows buckets, not parameters, so each bucket becomes one entry of the
profile (`prebucketed`): the simulation keeps the engine's own buckets rather
than bucketing again. The first step is skipped (it runs before the buckets are
rebuilt in ready order); the others give medians. The optimizer term is the time
outside forward and backward: the optimizer's slice plus the gap before forward.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from lockstep.observe.trace import load_events
from lockstep.plan.profile import ParamTiming, StepProfile


def _steps_of_rank(events: list[dict[str, Any]], rank: int, path: str) -> dict[int, list[dict]]:
    by_step: dict[int, list[dict]] = defaultdict(list)
    ranks = set()
    for event in events:
        args = event.get("args") or {}
        if event.get("ph") in ("X", "i") and "step" in args:
            ranks.add(int(event["pid"]))
            if int(event["pid"]) == rank:
                by_step[int(args["step"])].append(event)
    if not by_step:
        raise ValueError(
            f"--profile-trace: {path} holds no step of rank {rank} (ranks found: "
            f"{sorted(ranks) or 'none'}); expected a trace written with LOCKSTEP_TRACE=<dir>"
        )
    return by_step


def _one_step(events: list[dict]) -> tuple[float, float, float, dict[int, tuple]] | None:
    """(forward, backward, optimizer seconds, {bucket: (bytes, ready from backward start)})."""
    slices = {e["cat"]: e for e in events if e["ph"] == "X"}
    if "forward" not in slices or "backward" not in slices:
        return None
    forward = slices["forward"]["dur"] / 1e6
    # The time outside forward and backward: the optimizer's slice (a Monitor's trace)
    # and the gap before forward (an env-var trace puts optimizer and data loading there).
    optimizer = sum(slices[c]["dur"] / 1e6 for c in ("optimizer", "data") if c in slices)
    buckets = {
        int(e["args"]["bucket"]): (int(e["args"]["bytes"]), e["args"]["ready_ms"] / 1e3 - forward)
        for e in events
        if e.get("cat") == "ready"
    }
    return forward, slices["backward"]["dur"] / 1e6, optimizer, buckets


def profile_from_trace(path: str | Path, rank: int = 0) -> StepProfile:
    """The median step of `rank` in a trace file or directory, one entry per bucket.

    Raises:
        ValueError: unreadable trace, no step of that rank, or no step with buckets.
    """
    try:
        events = load_events(path)
    except ValueError as error:
        raise ValueError(f"--profile-trace: {error}") from None
    by_step = _steps_of_rank(events, rank, str(path))
    steps = sorted(by_step)
    usable = [_one_step(by_step[s]) for s in (steps[1:] if len(steps) > 1 else steps)]
    runs = [r for r in usable if r is not None and r[3]]
    if not runs:
        raise ValueError(
            f"--profile-trace: {path} has no step of rank {rank} with forward, backward and "
            "bucket events; record it with lockstep.DistributedDataParallel under a Monitor"
        )
    # Keep the steps laid out like the last one (the buckets are rebuilt once, early).
    sizes = {b: n for b, (n, _) in runs[-1][3].items()}
    runs = [r for r in runs if {b: n for b, (n, _) in r[3].items()} == sizes]
    params = tuple(
        ParamTiming(f"bucket {b}", n, 1, "bucket", statistics.median(r[3][b][1] for r in runs))
        for b, n in sorted(sizes.items())
    )
    source = f"trace {path}, rank {rank}, median of {len(runs)} step(s)"
    return StepProfile(
        params,
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        statistics.median(r[2] for r in runs),
        source,
        prebucketed=True,
    )
