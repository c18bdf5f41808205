"""What the observe layer costs: training with `lockstep.Monitor` on against off, on gloo/CPU.

    python benchmarks/observe_cost.py                          # world size 2, all workloads
    python benchmarks/observe_cost.py --reps 8 --steps-per-rep 20 --workloads mlp

Each rank trains the benchmark workloads (benchmarks/workloads.py) with
lockstep's DistributedDataParallel and SGD, in alternating phases (off/on then
on/off, so drift hits both), one thread per rank. "On" is the most expensive
setting: optimizer timed through its hooks, a log line and JSONL every 10 steps
(the interval's losses all-reduced), the Chrome trace recorded every step, a
straggler all-gather every 50 steps. Reported per workload: median step time
off and on and their ratio (median over repetitions; on a shared machine this
ratio carries the machine's noise), and the direct cost: the CPU time of the
process inside `Monitor.step()` (its own work, the interval's all-reduce and
JSONL write, the straggler exchange; not the time spent blocked waiting for a
slower rank, which the next gradient all-reduce would wait anyway), averaged
over all steps, as a share of the median step time. The trace's file is written
at `close()`, once per run, outside the timed steps.
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


class Trainer:
    """One DDP replica of a workload; `phase` trains some steps with or without a Monitor."""

    def __init__(self, ctx: lockstep.DistContext, name: str, out: str) -> None:
        self.ctx, self.workload, self.out = ctx, WORKLOADS[name], out
        self.ddp = lockstep.DistributedDataParallel(build(name))
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        self.batches = [self.workload.batch(gen) for _ in range(4)]

    def _monitor(self) -> lockstep.Monitor:
        return lockstep.Monitor(
            self.ddp, self.ctx, optimizer=self.opt, log_every=10, log_dir=self.out,
            trace=Path(self.out) / "trace", straggler_every=50, progress=False,
            stream=io.StringIO(),
        )  # fmt: skip

    def phase(self, steps: int, on: bool) -> tuple[list[float], list[float]]:
        """Step times and, when on, the CPU time each Monitor.step() call took."""
        monitor = self._monitor() if on else None
        dist.barrier()
        times, inside = [], []
        for i in range(steps):
            x, y = self.batches[i % len(self.batches)]
            start = time.perf_counter()
            loss = self.workload.loss(self.ddp(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            if monitor is not None:
                before = time.process_time()
                monitor.step(loss, batch_size=len(x))
                inside.append(time.process_time() - before)
            times.append(time.perf_counter() - start)
        if monitor is not None:
            monitor.close()
        return times, inside


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"observe-cost-{ctx.rank}-") as out:
        for name in args.workloads:
            trainer = Trainer(ctx, name, out)
            trainer.phase(args.warmup, on=False)
            runs = {"off": [], "on": []}
            inside: list[float] = []
            for rep in range(args.reps):
                for on in (False, True) if rep % 2 == 0 else (True, False):
                    times, spent = trainer.phase(args.steps_per_rep, on)
                    runs["on" if on else "off"].append(times)
                    inside.extend(spent)
            results[name] = {"runs": runs, "inside": inside}
    return results


def summarize(raw: dict) -> dict:
    """Rank 0's timings -> the reported figures (milliseconds, ratios, shares)."""
    off = [t for rep in raw["runs"]["off"] for t in rep]
    on = [t for rep in raw["runs"]["on"] for t in rep]
    ratios = [
        statistics.median(b) / statistics.median(a)
        for a, b in zip(raw["runs"]["off"], raw["runs"]["on"], strict=True)
    ]
    inside = raw["inside"]
    return {
        "ms_off": 1e3 * statistics.median(off),
        "ms_on": 1e3 * statistics.median(on),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "us_cpu_mean": 1e6 * statistics.fmean(inside),
        "share": statistics.fmean(inside) / statistics.median(off),
    }


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| workload | ms/step off | ms/step on | ratio on/off median (min-max) "
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
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps-per-rep", type=int, default=20)
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(f"world size {args.world_size}, gloo, 1 thread per rank")
    print(table({name: summarize(results[0][name]) for name in args.workloads}))


if __name__ == "__main__":
    main()
