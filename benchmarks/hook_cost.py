"""What each gradient costs the engine: long, steady runs on many small tensors.

    python benchmarks/hook_cost.py                 # world size 2, 200 x Linear(64, 64)
    python benchmarks/hook_cost.py --reps 5 --steps 100

The engine's per-gradient work is Python (a post-accumulate-grad hook), torch
DDP's is C++; the gap shows most when a step is hundreds of small tensors. This
benchmark times 400-tensor steps in long runs (fewer, steadier numbers than
engine_vs_torch.py's short phases), in both ways gradients reach the hooks:
  set_to_none: `zero_grad()` (the default) leaves .grad None, autograd allocates a
      fresh gradient, the hook copies it into the bucket (scaled by 1/N);
  in_place: `zero_grad(set_to_none=False)` keeps .grad as the bucket view, autograd
      accumulates into it, the hook only counts it (the bucket is divided by N
      once, at launch).
Engines run in turn within one process group: lockstep, torch DDP, and the
model alone (no communication). Reported: median step time per engine over the
repetitions, the ratio lockstep / torch, and the mean time spent in
`Reducer._mark_ready` per call (measured with a wrapper that adds ~0.2 us).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.engine import reducer
from lockstep.testing import run_ranks

ENGINES = ("lockstep", "torch", "none")
MODES = {"set_to_none": True, "in_place": False}


def _wrap(engine: str, model: nn.Module) -> nn.Module:
    if engine == "lockstep":
        return lockstep.DistributedDataParallel(model)
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    return model


def rank_main(ctx, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    workload = WORKLOADS[args.workload]
    inside = [0.0, 0]
    original = reducer.Reducer._mark_ready

    def timed(self, step, index, param):
        start = time.perf_counter()
        original(self, step, index, param)
        inside[0] += time.perf_counter() - start
        inside[1] += 1

    reducer.Reducer._mark_ready = timed
    batch = workload.batch(torch.Generator().manual_seed(ctx.rank))
    runs = {(e, m): _wrap(e, build(args.workload)) for e in ENGINES for m in MODES}
    out: dict = {key: {"ms": [], "us_mark": []} for key in runs}
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for (engine, mode), model in runs.items():
            inside[:] = [0.0, 0]
            start = time.perf_counter()
            for _ in range(args.steps):
                model.zero_grad(set_to_none=MODES[mode])
                workload.loss(model(batch[0]), batch[1]).backward()
            elapsed = time.perf_counter() - start
            if rep:
                out[(engine, mode)]["ms"].append(elapsed / args.steps * 1e3)
                out[(engine, mode)]["us_mark"].append(inside[0] / max(1, inside[1]) * 1e6)
    return out


def table(result: dict, world: int, workload: str) -> str:
    lines = [
        f"world size {world}, {workload}, median over repetitions (rank 0)",
        "",
        "| gradients | ms/step lockstep / torch / none | lockstep/torch | us per _mark_ready |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        ms = {e: statistics.median(result[(e, mode)]["ms"]) for e in ENGINES}
        mark = statistics.median(result[("lockstep", mode)]["us_mark"])
        lines.append(
            f"| {mode} | {ms['lockstep']:.1f} / {ms['torch']:.1f} / {ms['none']:.1f} "
            f"| {ms['lockstep'] / ms['torch']:.3f} | {mark:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workload", default="linear-200x64", choices=list(WORKLOADS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(table(results[0], args.world_size, args.workload))


if __name__ == "__main__":
    main()
