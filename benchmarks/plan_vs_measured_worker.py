"""The rank side of benchmarks/plan_vs_measured.py: profile, link, slowdown, then the engine.

    lockstep run --nnodes 2 ... --nproc-per-node 2 benchmarks/plan_vs_measured_worker.py \
        --reps 3 --steps 5 --out DIR      # what plan_vs_measured.py --nodes 2 starts

Per repetition, on every rank at once (so the cores are as loaded as in training):
1. profile each workload on this process alone (no process group): the figures
   `lockstep plan --profile` would take (lockstep.plan.profile.profile_step);
2. the link: the all-reduce sweep of `lockstep bench allreduce` and its slowdown
   while every rank computes (lockstep.bench.slowdown);
3. the engine: the same workload under lockstep.DistributedDataParallel; per step the
   wall time (forward to the end of the optimizer) and the engine's `StepStats`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.bench.allreduce_worker import SweepOptions, run_sweep
from lockstep.bench.slowdown import measure_slowdown
from lockstep.bench.sweep import result_json, sweep_sizes
from lockstep.observe.trace import TraceRecorder
from lockstep.plan.profile import profile_step

SWEEP = SweepOptions(tuple(sweep_sizes(4096, 64 * 2**20, 4, 4)), "fp32", iters=4, warmup=1)


def _profile(name: str, gen: torch.Generator, steps: int, warmup: int):
    workload, model = WORKLOADS[name], build(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run_step():
        inputs, targets = workload.batch(gen)
        return model(inputs), lambda out: workload.loss(out, targets)

    return profile_step(model, run_step, opt, steps=steps, warmup=warmup, source=name)


def _engine(ddp, opt, name: str, gen: torch.Generator, steps: int, trace: TraceRecorder | None):
    workload, out = WORKLOADS[name], {"step_s": [], "stats": []}
    for _ in range(steps):
        inputs, targets = workload.batch(gen)
        dist.barrier()  # every rank starts the step together, as in steady training
        begin = time.perf_counter()
        workload.loss(ddp(inputs), targets).backward()
        opt_start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = time.perf_counter()
        out["step_s"].append(end - ddp.stats.start)
        out["stats"].append(ddp.stats)
        if trace is not None:
            trace.record(
                SimpleNamespace(step=ddp.stats.step), ddp.stats, begin, end, (opt_start, end)
            )
    out["layout"] = [b.nbytes for b in ddp.stats.buckets]
    return out


def measure(ctx: lockstep.DistContext, names: list[str], args: argparse.Namespace) -> dict:
    """This rank's profiles, links and engine steps, per repetition."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    engines = {}
    for name in names:
        ddp = lockstep.DistributedDataParallel(build(name))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        _engine(ddp, opt, name, gen, args.warmup, None)  # the rebuild happens here
        engines[name] = (ddp, opt)
    trace = None
    if args.trace_dir and ctx.rank == 0:
        trace = TraceRecorder(args.trace_dir, ctx.rank, ctx.world_size, max_steps=args.steps)
    reps = []
    for rep in range(args.reps):
        record = {"profile": {}, "engine": {}}
        for name in names:
            record["profile"][name] = _profile(name, gen, args.steps, 1)
        record["sweep"] = result_json(run_sweep(ctx, SWEEP), ctx.world_size, {})
        record["slowdown"] = measure_slowdown(ctx.device, 6, 1)
        for name in names:
            last = trace if (name == args.trace_workload and rep == args.reps - 1) else None
            record["engine"][name] = _engine(*engines[name], name, gen, args.steps, last)
        reps.append(record)
    if trace is not None:
        trace.write()
    return {"rank": ctx.rank, "reps": reps}


def add_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workloads", default=",".join(WORKLOADS))
    add("--reps", type=int, default=3, help="interleaved repetitions")
    add("--steps", type=int, default=5, help="profiled and engine steps per repetition")
    add("--warmup", type=int, default=2, help="engine steps before the first repetition")
    add("--trace-dir", default=None, help="rank 0 writes the engine's trace of one workload")
    add("--trace-workload", default="gpt-5m")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser)
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes result.pt here")
    args = parser.parse_args()
    ctx = lockstep.init()
    try:
        mine = measure(ctx, args.workloads.split(","), args)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
    finally:
        lockstep.shutdown()
    if ctx.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(gathered, args.out / "result.pt")
        (args.out / "done.json").write_text(json.dumps({"world_size": ctx.world_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
