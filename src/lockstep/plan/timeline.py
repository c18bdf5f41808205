"""The predicted step as a Chrome trace and a timeline PNG, in the measured timeline's format.

`predicted_events` writes the simulated step with the same event names,
categories and arguments as a real run's trace (observe/trace.py), so
`observe.plot.plot_timeline` draws it exactly as it draws a measured step, and
the two pictures can be laid side by side; the JSON opens in Perfetto too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lockstep.observe.plot import plot_timeline
from lockstep.observe.trace import COMPUTE_TID, bucket_tid
from lockstep.plan.simulate import SimStep

PID = 0  # the predicted step is drawn as one rank's lane


def _slice(name: str, cat: str, t0: float, t1: float, tid: int, args: dict) -> dict[str, Any]:
    dur = round(max(t1 - t0, 0.0) * 1e6, 3)
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": PID,
        "tid": tid,
        "ts": round(t0 * 1e6, 3),
        "dur": dur,
        "args": args,
    }


def predicted_events(sim: SimStep, step: int = 1) -> list[dict[str, Any]]:
    """The trace events of one predicted step, from t = 0 at the start of forward."""
    args = {"step": step}
    fwd, bwd = sim.forward_s, sim.backward_end
    waited = bwd + sim.exposed_s
    opt_end = waited + sim.optimizer_s
    events = [
        _slice(f"step {step}", "step", 0.0, sim.step_s, COMPUTE_TID, args),
        _slice("forward", "forward", 0.0, fwd, COMPUTE_TID, args),
        _slice("backward", "backward", fwd, bwd, COMPUTE_TID, args),
        _slice("optimizer", "optimizer", waited, opt_end, COMPUTE_TID, args),
    ]
    if sim.exposed_s > 0:
        events.append(_slice("wait for all-reduce", "exposed", bwd, waited, COMPUTE_TID, args))
    if sim.tail_s > 0:
        events.append(
            _slice("all-gather after optimizer", "exposed", opt_end, sim.step_s, COMPUTE_TID, args)
        )
    for b in sim.buckets:
        info = {
            **args,
            "bucket": b.index,
            "bytes": b.nbytes,
            "params": len(b.params),
            "ready_ms": round(b.ready * 1e3, 3),
        }
        events.append(
            {
                "name": f"bucket {b.index} ready",
                "cat": "ready",
                "ph": "i",
                "s": "t",
                "pid": PID,
                "tid": bucket_tid(b.index),
                "ts": round(b.ready * 1e6, 3),
                "args": info,
            }
        )
        events.append(
            _slice(
                f"all-reduce bucket {b.index}",
                "allreduce",
                b.launched,
                b.done,
                bucket_tid(b.index),
                info,
            )
        )
    return events


def write_predicted(sim: SimStep, png: str | Path) -> tuple[Path, Path]:
    """Write the predicted step as `<png stem>.trace.json` and draw it to `png`.

    Returns:
        (the PNG, the trace JSON).

    Raises:
        ValueError: matplotlib is missing.
    """
    png = Path(png)
    trace = png.with_suffix(".trace.json")
    trace.parent.mkdir(parents=True, exist_ok=True)
    meta = {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "predicted"}}
    document = {"traceEvents": [meta, *predicted_events(sim)], "displayTimeUnit": "ms"}
    trace.write_text(json.dumps(document))
    return plot_timeline(trace, png, steps=1), trace
