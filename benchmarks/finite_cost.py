"""What the non-finite check (`runtime/finite.py`) costs per step, measured in isolation.

    python benchmarks/finite_cost.py                 # world size 2, all workloads
    python benchmarks/finite_cost.py --steps 8 --reps 6 --world-size 4

On a busy machine the "finite on/off" column of `engine_vs_torch.py` drowns in
noise, so this measures the check's own parts inside a real training step of
lockstep's engine (gloo, one thread per rank): the per-bucket sums
(`FiniteGuard.check_bucket`, timed around each call), the count of non-finite sums
that goes out in the step fingerprint (`FiniteGuard.verdict`) and the end-of-step
decision (`FiniteGuard.end_step`, which reads the agreed count), against the whole
step. Two copies of the model train in turns (A/B then B/A, `--reps` times
`--steps` steps): with the check (`nonfinite="raise"`, the default) and without
(`nonfinite="off"`); the last column is the step's CPU time with the check over
without, per repetition (median, min-max): the check's cost with its cache effects
on the rest of the step, noisier than the timed parts. Reported: medians over steps in
milliseconds, in CPU time of this process (what other processes' load does not
inflate much) and in wall time, and the share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.testing import run_ranks

PARTS = ("sums", "verdict", "decision")
VARIANTS = ("raise", "off")


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


class Trainer:
    """One copy of the workload's model under lockstep's engine, with the check's variant."""

    def __init__(self, name: str, variant: str) -> None:
        self.work = WORKLOADS[name]
        self.model = lockstep.DistributedDataParallel(build(name), nonfinite=variant)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.parts = _timed_parts(self.model) if variant != "off" else {}

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        self.opt.zero_grad()
        self.work.loss(self.model(batch[0]), batch[1]).backward()
        self.opt.step()
        figures = {"step": time.perf_counter() - wall, "step_cpu": time.process_time() - cpu}
        for part in PARTS:
            timed = self.parts.get(part)
            figures[part], figures[part + "_cpu"] = timed.take() if timed else (0.0, 0.0)
        return figures


def _measure(ctx: lockstep.DistContext, name: str, args: argparse.Namespace) -> dict:
    trainers = {v: Trainer(name, v) for v in VARIANTS}
    batch = WORKLOADS[name].batch(torch.Generator().manual_seed(100 + ctx.rank))
    for trainer in trainers.values():  # warm-up: the buckets are rebuilt after the first step
        for _ in range(3):
            trainer.step(batch)
    out: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    per_rep: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            cpu = []
            for _ in range(args.steps):
                figures = trainers[v].step(batch)
                cpu.append(figures["step_cpu"])
                for key, value in figures.items():
                    out[v].setdefault(key, []).append(value)
            per_rep[v].append(statistics.median(cpu))
    for v in VARIANTS:
        ratios = [a / b for a, b in zip(per_rep[v], per_rep["off"], strict=True)]
        out[v]["cpu_over_off"] = ratios
    return out


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: _measure(ctx, name, args) for name in args.workloads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=8, help="steps per repetition")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    load = Path("/proc/loadavg").read_text().split()[:3]
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(
        f"world size {args.world_size}, load average at start {' '.join(load)}\n"
        "| workload | nonfinite | step ms (cpu) | bucket sums ms (cpu) "
        "| verdict ms (cpu) | decision ms (cpu) | check / step, wall (cpu) "
        "| step cpu / off's, median (min-max) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.workloads:
        for variant in VARIANTS:
            raw = results[0][name][variant]
            ratios = raw.pop("cpu_over_off")
            m = {k: 1e3 * statistics.median(v) for k, v in raw.items()}
            share = sum(m[p] for p in PARTS) / m["step"]
            share_cpu = sum(m[p + "_cpu"] for p in PARTS) / m["step_cpu"]
            cells = " | ".join(f"{m[p]:.3f} ({m[p + '_cpu']:.3f})" for p in PARTS)
            print(
                f"| {name} | {variant} | {m['step']:.1f} ({m['step_cpu']:.1f}) | {cells} | "
                f"{share:.1%} ({share_cpu:.1%}) | {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f}) |"
            )


if __name__ == "__main__":
    main()
