"""What the observe layer costs: `lockstep.Monitor`, and LOCKSTEP_TRACE, on against off (gloo/CPU).

    python benchmarks/observe_cost.py                          # world size 2, all workloads
    python benchmarks/observe_cost.py --steps 400 --workloads mlp-8x1024
    python benchmarks/observe_cost.py --compare env-trace      # LOCKSTEP_TRACE only

Each rank trains a benchmark workload (benchmarks/workloads.py) with lockstep's
DistributedDataParallel and SGD, one thread per rank, and calls `Monitor.step()`
after half of the steps, in the pattern on/off/off/on, so that steps compared
with each other are neighbours and share whatever else the machine is doing.
The monitor runs with everything on: the optimizer timed through its hooks, a
log line and JSONL records every 10 calls (the interval's losses all-reduced),
the Chrome trace recorded at every call, and a straggler
all-gather every 50 calls. Reported per workload, for the steps with the
monitor off and on: the median wall time and the median CPU time of the process
(all its threads: gloo's included; time spent blocked, waiting for the other
rank or for a core the machine's other jobs hold, is not CPU time), and their
on/off ratios per block of 10 + 10 steps (median and range over blocks). The
wall ratio also moves waiting around: the interval's loss all-reduce makes a
rank wait for a slower peer in an "on" step rather than in the next gradient
all-reduce. Last, the direct cost: the CPU time inside `Monitor.step()`,
averaged over the calls (so the flushes and exchanges are spread as in a run
that calls it every step), as a share of the median CPU time of a step without it.
The trace's file is written at `close()`, outside the timed steps.

`--compare env-trace` measures LOCKSTEP_TRACE the same way: each rank builds two
replicas of the workload, one with the variable set (the engine's step observer
and the background writer, every 5 s, as in a real run) and one without, and
steps them in the same on/off/off/on pattern. Its direct cost is the CPU time of
the observer's call per step and of one background write of the file.
"""

from __future__ import annotations

import argparse
import io
import os
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

    The monitor counts its own calls: every 10th call flushes, every 50th exchanges
    straggler data, so the mean cost of a call is the cost per step of a run that
    calls it every step with log_every=10 and straggler_every=50.
    """

    def __init__(self, ctx: lockstep.DistContext, name: str, out: str) -> None:
        self.ctx, self.workload, self.out = ctx, WORKLOADS[name], out
        self.ddp = lockstep.DistributedDataParallel(build(name))
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        self.batches = [self.workload.batch(gen) for _ in range(4)]

    def run(self, warmup: int, steps: int) -> dict[str, list[float]]:
        """Wall and CPU times of the steps with the Monitor off and on, and of Monitor.step()."""
        monitor = lockstep.Monitor(
            self.ddp,
            self.ctx,
            optimizer=self.opt,
            log_every=10,
            log_dir=self.out,
            trace=Path(self.out) / "trace",
            straggler_every=50,
            progress=False,
            stream=io.StringIO(),
        )
        times: dict[str, list[float]] = {k: [] for k in ("off", "on", "cpu_off", "cpu_on")}
        inside = []
        dist.barrier()
        for i in range(warmup + steps):
            x, y = self.batches[i % len(self.batches)]
            observed = ON_PATTERN[i % len(ON_PATTERN)]
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = self.workload.loss(self.ddp(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            if observed:
                before = time.process_time()
                monitor.step(loss, batch_size=len(x))
                inside.append(time.process_time() - before)
            if i >= warmup:
                kind = "on" if observed else "off"
                times[kind].append(time.perf_counter() - start)
                times[f"cpu_{kind}"].append(time.process_time() - cpu_start)
        monitor.close()
        return {**times, "inside": inside[warmup // 2 :]}


class EnvTraceTrainer:
    """Two replicas of a workload, one wrapped with LOCKSTEP_TRACE set; steps alternate."""

    def __init__(self, ctx: lockstep.DistContext, name: str, out: str) -> None:
        self.workload = WORKLOADS[name]
        os.environ["LOCKSTEP_TRACE"] = str(Path(out) / "env-trace")
        self.traced = lockstep.DistributedDataParallel(build(name))
        del os.environ["LOCKSTEP_TRACE"]
        self.plain = lockstep.DistributedDataParallel(build(name))
        assert self.plain.env_tracer is None and self.traced.env_tracer is not None
        self.opts = {m: torch.optim.SGD(m.parameters(), lr=1e-4) for m in (self.traced, self.plain)}
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        self.batches = [self.workload.batch(gen) for _ in range(4)]

    def run(self, warmup: int, steps: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {k: [] for k in ("off", "on", "cpu_off", "cpu_on")}
        dist.barrier()
        for i in range(warmup + steps):
            x, y = self.batches[i % len(self.batches)]
            observed = ON_PATTERN[i % len(ON_PATTERN)]
            ddp = self.traced if observed else self.plain
            start, cpu_start = time.perf_counter(), time.process_time()
            self.workload.loss(ddp(x), y).backward()
            self.opts[ddp].step()
            self.opts[ddp].zero_grad()
            if i >= warmup:
                kind = "on" if observed else "off"
                times[kind].append(time.perf_counter() - start)
                times[f"cpu_{kind}"].append(time.process_time() - cpu_start)
        return {**times, **self._direct_cost()}

    def _direct_cost(self) -> dict[str, list[float]]:
        """CPU seconds of one observer call (mean of 1000) and of one write of the file."""
        tracer, stats = self.traced.env_tracer, self.traced.stats
        before = time.process_time()
        for _ in range(1000):
            tracer(stats)
        call = (time.process_time() - before) / 1000
        before = time.process_time()
        tracer.recorder.write()
        write = time.process_time() - before
        tracer.close()
        return {"inside": [call], "write": [write], "flush_s": [tracer.flush_s]}


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    trainer = EnvTraceTrainer if args.compare == "env-trace" else Trainer
    return {
        name: trainer(ctx, name, args.out).run(args.warmup, args.steps) for name in args.workloads
    }


def _block_ratios(on: list[float], off: list[float], block: int = 10) -> list[float]:
    n = min(len(on), len(off))
    return [
        statistics.median(on[i : i + block]) / statistics.median(off[i : i + block])
        for i in range(0, n - block + 1, block)
    ]


def summarize(raw: dict) -> dict:
    """Rank 0's timings -> the reported figures (milliseconds, ratios, shares)."""
    wall = _block_ratios(raw["on"], raw["off"])
    cpu = _block_ratios(raw["cpu_on"], raw["cpu_off"])
    cpu_off = statistics.median(raw["cpu_off"])
    return {
        "ms": (1e3 * statistics.median(raw["off"]), 1e3 * statistics.median(raw["on"])),
        "cpu_ms": (1e3 * cpu_off, 1e3 * statistics.median(raw["cpu_on"])),
        "wall_ratio": (statistics.median(wall), min(wall), max(wall)),
        "cpu_ratio": (statistics.median(cpu), min(cpu), max(cpu)),
        "us_inside": 1e6 * statistics.fmean(raw["inside"]),
        "share": statistics.fmean(raw["inside"]) / cpu_off,
        "write_ms": 1e3 * raw["write"][0] if "write" in raw else None,
        "write_share": raw["write"][0] / raw["flush_s"][0] if "write" in raw else None,
    }


def _ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"


def table(rows: dict[str, dict], env_trace: bool = False) -> str:
    inside = "observer CPU us/step" if env_trace else "Monitor.step() CPU us"
    extra = " file write CPU ms (share of 5 s) |" if env_trace else ""
    lines = [
        "| workload | wall ms/step off / on | wall ratio on/off | CPU ms/step off / on "
        f"| CPU ratio on/off | {inside} | share of a step's CPU time |{extra}",
        "|---|---|---|---|---|---|---|" + ("---|" if env_trace else ""),
    ]
    for name, r in rows.items():
        write = f" {r['write_ms']:.1f} ({r['write_share']:.2%}) |" if env_trace else ""
        lines.append(
            f"| {name} | {r['ms'][0]:.1f} / {r['ms'][1]:.1f} | {_ratio(r['wall_ratio'])} | "
            f"{r['cpu_ms'][0]:.1f} / {r['cpu_ms'][1]:.1f} | {_ratio(r['cpu_ratio'])} | "
            f"{r['us_inside']:.1f} | {r['share']:.3%} |{write}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400, help="timed steps, half of them on")
    parser.add_argument(
        "--compare",
        choices=("monitor", "env-trace"),
        default="monitor",
        help="what is on in the 'on' steps: a Monitor, or LOCKSTEP_TRACE (a traced replica)",
    )
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    with tempfile.TemporaryDirectory(prefix="observe-cost-") as out:  # shared by the ranks
        args.out = out
        results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(f"world size {args.world_size}, gloo, 1 thread per rank, on = {args.compare}")
    rows = {name: summarize(results[0][name]) for name in args.workloads}
    print(table(rows, env_trace=args.compare == "env-trace"))


if __name__ == "__main__":
    main()
