"""What the non-finite check (`runtime/finite.py`) costs per step, measured in isolation.

    python benchmarks/finite_cost.py                 # world size 2, all workloads
    python benchmarks/finite_cost.py --steps 40 --world-size 4

On a busy machine the "finite on/off" column of `engine_vs_torch.py` drowns in
noise, so this measures the check's own parts inside a real training step of
lockstep's engine (gloo, one thread per rank): the per-bucket sums
(`FiniteGuard.check_bucket`, timed around each call), the count of non-finite sums
that goes out in the step fingerprint (`FiniteGuard.verdict`) and the end-of-step
decision (`FiniteGuard.end_step`, which reads the agreed count), against the whole
step. Reported: medians over steps in milliseconds, in CPU time of this process
(what other processes' load does not inflate much) and in wall time, and the share
of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.testing import run_ranks

PARTS = ("sums", "verdict", "decision")


class Timed:
    """`inner`, adding the wall and CPU time of every call to two totals."""

    def __init__(self, inner: Callable[..., object]) -> None:
        self.inner = inner
        self.wall = self.cpu = 0.0

    def __call__(self, *args: object) -> object:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return self.inner(*args)
        finally:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu

    def take(self) -> tuple[float, float]:
        taken, self.wall, self.cpu = (self.wall, self.cpu), 0.0, 0.0
        return taken


def _timed_parts(model: lockstep.DistributedDataParallel) -> dict[str, Timed]:
    """The check's three parts, timed where the engine calls them."""
    guard, driver = model.nonfinite, model.reducer.driver
    parts = {"sums": Timed(guard.check_bucket), "verdict": Timed(driver.verdict)}
    guard.check_bucket = parts["sums"]  # type: ignore[method-assign]
    driver.verdict = parts["verdict"]
    at = driver.end_of_step.index(guard.end_step)
    parts["decision"] = driver.end_of_step[at] = Timed(guard.end_step)
    return parts


def _measure(ctx: lockstep.DistContext, name: str, steps: int) -> dict[str, list[float]]:
    work = WORKLOADS[name]
    model = lockstep.DistributedDataParallel(build(name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    parts = _timed_parts(model)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    batch = work.batch(gen)
    out: dict[str, list[float]] = {}
    for i in range(steps + 3):
        wall, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad()
        work.loss(model(batch[0]), batch[1]).backward()
        opt.step()
        figures = {"step": time.perf_counter() - wall, "step_cpu": time.process_time() - cpu}
        for part, timed in parts.items():
            figures[part], figures[part + "_cpu"] = timed.take()
        if i >= 3:  # warm-up: the buckets are rebuilt after the first step
            for key, value in figures.items():
                out.setdefault(key, []).append(value)
    return out


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: _measure(ctx, name, args.steps) for name in args.workloads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(
        f"world size {args.world_size}\n| workload | step ms (cpu) | bucket sums ms (cpu) "
        "| verdict ms (cpu) | decision ms (cpu) | check / step, wall (cpu) |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.workloads:
        m = {k: 1e3 * statistics.median(v) for k, v in results[0][name].items()}
        share = sum(m[p] for p in PARTS) / m["step"]
        share_cpu = sum(m[p + "_cpu"] for p in PARTS) / m["step_cpu"]
        cells = " | ".join(f"{m[p]:.3f} ({m[p + '_cpu']:.3f})" for p in PARTS)
        print(
            f"| {name} | {m['step']:.1f} ({m['step_cpu']:.1f}) | {cells} | "
            f"{share:.1%} ({share_cpu:.1%}) |"
        )


if __name__ == "__main__":
    main()
