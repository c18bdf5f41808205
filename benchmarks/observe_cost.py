"""What the observe layer costs: training with `lockstep.Monitor` on against off, on gloo/CPU.

    python benchmarks/observe_cost.py                          # world size 2, all workloads
    python benchmarks/observe_cost.py --steps 400 --workloads mlp-8x1024

Each rank trains a benchmark workload (benchmarks/workloads.py) with lockstep's
DistributedDataParallel and SGD, one thread per rank, and calls `Monitor.step()`
after half of the steps, in the pattern on/off/off/on, so that steps compared
with each other are neighbours and share whatever else the machine is doing.
The monitor is in its most expensive setting: optimizer timed through its
hooks, a log line and JSONL records every 10 steps of training (the interval's
losses all-reduced), the Chrome trace recorded every step, a straggler
all-gather every 50 steps. Reported per workload: median step time off and on,
and their ratio (per block of 10 + 10 steps; median and range over blocks); and
the direct cost: the CPU time of the process inside `Monitor.step()` (its own
work, the interval's all-reduce and JSONL write, the straggler exchange; not the
time spent blocked waiting for a slower rank, which the next gradient all-reduce
would wait anyway), averaged over the calls, as a share of the median step time
off. The trace's file is written at `close()`, outside the timed steps.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.testing import run_ranks

ON_PATTERN = (True, False, False, True)  # on/off/off/on: neighbours share the machine's mood


class Trainer:
    """One DDP replica of a workload, trained with a Monitor that is called on half the steps.

    The monitor counts its own calls, so log_every=5 and straggler_every=25 mean every
    10 and every 50 steps of training.
    """

    def __init__(self, ctx: lockstep.DistContext, name: str, out: str) -> None:
        self.ctx, self.workload, self.out = ctx, WORKLOADS[name], out
        self.ddp = lockstep.DistributedDataParallel(build(name))
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        self.batches = [self.workload.batch(gen) for _ in range(4)]

    def run(self, warmup: int, steps: int) -> tuple[list[float], list[float], list[float]]:
        """Step times with the Monitor off and on, and the CPU time of each Monitor.step()."""
        monitor = lockstep.Monitor(
            self.ddp, self.ctx, optimizer=self.opt, log_every=5, log_dir=self.out,
            trace=Path(self.out) / "trace", straggler_every=25, progress=False,
            stream=io.StringIO(),
        )  # fmt: skip
        off, on, cpu = [], [], []
        dist.barrier()
        for i in range(warmup + steps):
            x, y = self.batches[i % len(self.batches)]
            observed = ON_PATTERN[i % len(ON_PATTERN)]
            start = time.perf_counter()
            loss = self.workload.loss(self.ddp(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            if observed:
                before = time.process_time()
                monitor.step(loss, batch_size=len(x))
                cpu.append(time.process_time() - before)
            if i >= warmup:
                (on if observed else off).append(time.perf_counter() - start)
        monitor.close()
        return off, on, cpu[warmup // 2 :]


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"observe-cost-{ctx.rank}-") as out:
        for name in args.workloads:
            off, on, cpu = Trainer(ctx, name, out).run(args.warmup, args.steps)
            results[name] = {"off": off, "on": on, "cpu": cpu}
    return results


def summarize(raw: dict, block: int = 10) -> dict:
    """Rank 0's timings -> the reported figures (milliseconds, ratios, shares)."""
    off, on, cpu = raw["off"], raw["on"], raw["cpu"]
    ratios = [
        statistics.median(on[i : i + block]) / statistics.median(off[i : i + block])
        for i in range(0, min(len(on), len(off)) - block + 1, block)
    ]
    return {
        "ms_off": 1e3 * statistics.median(off),
        "ms_on": 1e3 * statistics.median(on),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "us_cpu_mean": 1e6 * statistics.fmean(cpu),
        "share": statistics.fmean(cpu) / statistics.median(off),
    }


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| workload | ms/step off | ms/step on | ratio on/off, median (min-max) of blocks "
        "| Monitor.step() CPU us, mean | cost share of a step |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['ms_off']:.2f} | {r['ms_on']:.2f} | {r['ratio_median']:.3f} "
            f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {r['us_cpu_mean']:.0f} "
            f"| {r['share']:.2%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200, help="timed steps, half of them on")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(f"world size {args.world_size}, gloo, 1 thread per rank")
    print(table({name: summarize(results[0][name]) for name in args.workloads}))


if __name__ == "__main__":
    main()
