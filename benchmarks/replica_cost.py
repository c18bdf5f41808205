"""What the replica check (`runtime/replica_check.py`) costs per step, on and off side by side.

    python benchmarks/replica_cost.py                      # world size 2, all workloads
    python benchmarks/replica_cost.py --steps 40 --world-size 4

Each rank builds the workload twice, one lockstep DDP with the check on and one with
it off (`check_replicas=False`), and runs them in alternating turns of `--turn`
steps (gloo, one thread per rank), so both see the same load. Reported, rank 0's
medians over steps in milliseconds of CPU time of the process (what other
processes' load inflates least), wall time in brackets: the whole step with the
check on and off, and the check's own parts timed where the engine calls them on the
"on" model: the parameters' digests as each bucket launches
(`ReplicaGuard.bucket_ready`), the fold sent in the fingerprint (`ReplicaGuard.digest`)
and the end-of-step verdict (`ReplicaGuard.end_step`). Their sum over the step is the
check's share; the on/off ratio is the same figure measured the other way, noisier.
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

PARTS = ("digests", "fold", "verdict")


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
    """The check's three parts, timed where the driver calls them."""
    guard, driver = model.replicas, model.reducer.driver
    parts = {"digests": Timed(guard.bucket_ready), "fold": Timed(guard.digest)}
    driver.digest_bucket = parts["digests"]
    driver.digest = parts["fold"]
    at = driver.end_of_step.index(guard.end_step)
    parts["verdict"] = driver.end_of_step[at] = Timed(guard.end_step)
    return parts


def _step(model, opt, work, batch) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    opt.zero_grad()
    work.loss(model(batch[0]), batch[1]).backward()
    opt.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def _measure(ctx: lockstep.DistContext, name: str, steps: int, turn: int) -> dict:
    work = WORKLOADS[name]
    on = lockstep.DistributedDataParallel(build(name), check_replicas=True)
    off = lockstep.DistributedDataParallel(build(name), check_replicas=False)
    opts = {m: torch.optim.SGD(m.parameters(), lr=1e-4) for m in (on, off)}
    parts = _timed_parts(on)
    batch = work.batch(torch.Generator().manual_seed(100 + ctx.rank))
    out: dict[str, list[float]] = {}
    for model in (on, off):  # warm-up: the buckets are rebuilt after the first step
        for _ in range(3):
            _step(model, opts[model], work, batch)
    for part in parts.values():
        part.take()
    done = 0
    while done < steps:
        for label, model in (("on", on), ("off", off)):
            for _ in range(turn):
                wall, cpu = _step(model, opts[model], work, batch)
                out.setdefault(label, []).append(wall)
                out.setdefault(label + "_cpu", []).append(cpu)
                if label == "on":
                    for part, timed in parts.items():
                        out.setdefault(part, []).append(0.0)
                        out.setdefault(part + "_cpu", []).append(0.0)
                        out[part][-1], out[part + "_cpu"][-1] = timed.take()
        done += turn
    return out


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: _measure(ctx, name, args.steps, args.turn) for name in args.workloads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--turn", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(
        f"world size {args.world_size}\n| workload | step on, cpu ms (wall) | step off, cpu ms "
        "(wall) | on / off, cpu | digests ms | fold ms | verdict ms | check / step, cpu (wall) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.workloads:
        m = {k: 1e3 * statistics.median(v) for k, v in results[0][name].items()}
        share_cpu = sum(m[p + "_cpu"] for p in PARTS) / m["on_cpu"]
        share = sum(m[p] for p in PARTS) / m["on"]
        cells = " | ".join(f"{m[p + '_cpu']:.3f}" for p in PARTS)
        print(
            f"| {name} | {m['on_cpu']:.1f} ({m['on']:.1f}) | {m['off_cpu']:.1f} ({m['off']:.1f}) "
            f"| {m['on_cpu'] / m['off_cpu']:.3f} | {cells} | {share_cpu:.1%} ({share:.1%}) |"
        )


if __name__ == "__main__":
    main()
