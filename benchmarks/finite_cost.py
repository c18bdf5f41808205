"""What the non-finite check (`runtime/finite.py`) costs per step, measured in isolation.

    python benchmarks/finite_cost.py                 # world size 2, all workloads
    python benchmarks/finite_cost.py --steps 40

On a busy machine the "finite on/off" column of `engine_vs_torch.py` drowns in
noise, so this measures the check's own two parts inside a real training step of
lockstep's engine (gloo, world size 2, one thread per rank): the per-bucket sums
(`FiniteGuard.check_bucket`, timed around each call) and the end-of-step verdict
(`FiniteGuard.end_step`, one 8-byte all-reduce), against the whole step. Reported:
medians over steps in milliseconds, in CPU time of this process (what other
processes' load does not inflate much) and in wall time, and the share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.runtime.finite import FiniteGuard
from lockstep.testing import run_ranks


class Timed:
    """Adds the wall and CPU time of every call of `FiniteGuard.<name>` to two totals."""

    def __init__(self, guard: FiniteGuard, name: str) -> None:
        self.wall = self.cpu = 0.0
        inner = getattr(guard, name)

        def timed(*args: object) -> object:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.process_time() - cpu

        setattr(guard, name, timed)

    def take(self) -> tuple[float, float]:
        taken, self.wall, self.cpu = (self.wall, self.cpu), 0.0, 0.0
        return taken


def _measure(ctx: lockstep.DistContext, name: str, steps: int) -> dict[str, list[float]]:
    work = WORKLOADS[name]
    model = lockstep.DistributedDataParallel(build(name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sums, verdict = Timed(model.nonfinite, "check_bucket"), Timed(model.nonfinite, "end_step")
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    batch = work.batch(gen)
    out: dict[str, list[float]] = {k: [] for k in ("step", "step_cpu", "sums", "sums_cpu")}
    out.update(verdict=[], verdict_cpu=[])
    for i in range(steps + 3):
        wall, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad()
        work.loss(model(batch[0]), batch[1]).backward()
        opt.step()
        figures = {
            "step": time.perf_counter() - wall,
            "step_cpu": time.process_time() - cpu,
        }
        figures["sums"], figures["sums_cpu"] = sums.take()
        figures["verdict"], figures["verdict_cpu"] = verdict.take()
        if i >= 3:  # warm-up: the buckets are rebuilt after the first step
            for key, value in figures.items():
                out[key].append(value)
    return out


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: _measure(ctx, name, args.steps) for name in args.workloads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    results = run_ranks(rank_main, 2, args, deadline_s=3600, timeout_s=600)
    print(
        "| workload | step ms (cpu) | bucket sums ms (cpu) | verdict all-reduce ms (cpu) "
        "| check / step, wall (cpu) |"
    )
    print("|---|---|---|---|---|")
    for name in args.workloads:
        m = {k: 1e3 * statistics.median(v) for k, v in results[0][name].items()}
        share = (m["sums"] + m["verdict"]) / m["step"]
        share_cpu = (m["sums_cpu"] + m["verdict_cpu"]) / m["step_cpu"]
        print(
            f"| {name} | {m['step']:.1f} ({m['step_cpu']:.1f}) | {m['sums']:.2f} "
            f"({m['sums_cpu']:.2f}) | {m['verdict']:.3f} ({m['verdict_cpu']:.3f}) | "
            f"{share:.1%} ({share_cpu:.1%}) |"
        )


if __name__ == "__main__":
    main()
