"""The LOCKSTEP_TRACE tracer inside a process: off means no work, on means background writes.

Two real gloo ranks build lockstep DDP models with the variable unset (no tracer,
no step observer: the engine does no tracing work), then set (the file appears
from the background thread, with no close and no exit, and holds exactly the
engine's steps and buckets), then a second model in the same process (it takes
the file over, with a warning), then a Monitor with trace=False (tracing off).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch
from engine_models import MLP

import lockstep
from lockstep.testing import run_ranks


def _steps_in(path: Path, deadline_s: float, want: int | None = None) -> set[int]:
    """The steps of a trace file once it holds `want`, or after `deadline_s` of polling."""
    deadline = time.monotonic() + deadline_s
    while True:
        steps = set()
        if path.exists():
            events = json.loads(path.read_text())["traceEvents"]
            steps = {e["args"]["step"] for e in events if "step" in e.get("args", {})}
        if want in steps or time.monotonic() > deadline:
            return steps
        time.sleep(0.02)


def _train(ddp, steps):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _rank(ctx, trace_dir):
    caps = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}
    off = lockstep.DistributedDataParallel(MLP(), **caps)
    result = {"off": (off.env_tracer, list(off.reducer.driver.observers))}
    os.environ["LOCKSTEP_TRACE"] = trace_dir
    on = lockstep.DistributedDataParallel(MLP(), **caps)
    _train(on, 3)
    path = Path(trace_dir) / f"trace_rank{ctx.rank}.json"
    result["background"] = _steps_in(path, 20.0, want=3)  # no close, no exit: the thread wrote it
    result["buckets"] = len(on.stats.buckets)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = lockstep.DistributedDataParallel(MLP(), **caps)
    result["warning"] = [str(w.message) for w in caught]
    _train(second, 2)
    second.env_tracer.close()
    result["second"] = _steps_in(path, 0.0)  # close() wrote it
    third = lockstep.DistributedDataParallel(MLP(), **caps)
    lockstep.Monitor(third, ctx, trace=False, straggler_every=0, progress=False).close()
    _train(third, 1)
    result["after_off"] = _steps_in(path, 1.0)  # 20 flush periods
    return result


def test_env_tracer_off_on_takeover_and_monitor_off(tmp_path):
    env = {"LOCKSTEP_TRACE_FLUSH_S": "0.05"}
    results = run_ranks(_rank, 2, str(tmp_path), env=env, deadline_s=180)
    for rank, result in enumerate(results):
        assert result["off"] == (None, [])
        assert result["background"] == {1, 2, 3}
        assert result["buckets"] >= 2
        assert any(f"trace_rank{rank}.json" in w for w in result["warning"])
        assert result["second"] == {1, 2}  # the second model's own steps replace the first's
        assert result["after_off"] == {1, 2}  # Monitor(trace=False): its steps were not written

