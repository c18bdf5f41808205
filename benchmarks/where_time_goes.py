"""Where a step's time goes: lockstep's engine against torch DDP, phase by phase, thread by thread.

    python benchmarks/where_time_goes.py --world-size 4                  # all workloads
    python benchmarks/where_time_goes.py --world-size 4 --workloads mlp-8x1024 --reps 6
    python benchmarks/where_time_goes.py --world-size 4 --first-bucket-mb 4 --bucket-mb 25
    python benchmarks/where_time_goes.py --world-size 4 --profile runs/where  # + op tables

`engine_vs_torch.py` says how the step times compare; this says why. The engines
(lockstep as it is, lockstep with `nonfinite="off"`, lockstep without the step
fingerprint, torch DDP and the step with no communication) train copies of the same
model in turns (A..E then E..A, `--reps` times `--steps` steps, the bucket caps of
both engines set alike), and each step is split by the clock into forward, backward
(the call, which ends when the last all-reduce is waited for) and optimizer. Each
thread of the rank's process is read from /proc/self/task/<tid>/schedstat before and
after every step: its time on a core and its time ready but waiting for one (the run
queue: with four ranks on two cores, the share of a step a thread could have run and
did not). Threads are grouped as the rank's main thread (forward, autograd, the
hooks, lockstep's launches) and the others (gloo's, which run the all-reduces). For
lockstep, the engine's own timeline (`StepStats`: per bucket, when it was ready,
launched, done) gives the bucket order, the first bucket's size and the tail that
backward waited for. `--profile DIR` adds one more turn of each engine under
torch.profiler: rank 0's ops by self CPU time (top 12 per engine) and a Chrome trace
per rank in DIR.
Rank 0's medians are printed; `--json` writes every rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.runtime.fingerprint import StepFingerprint
from lockstep.testing import run_ranks

ENGINES = ("lockstep", "lockstep_nocheck", "lockstep_nofp", "torch", "plain")
PHASES = ("step", "forward", "backward", "optimizer")
THREADS = ("main_cpu", "main_wait", "others_cpu", "others_wait", "process_cpu")


def thread_times(main: int) -> dict[str, float]:
    """Seconds on a core and seconds in the run queue so far: the main thread, the others."""
    out = dict.fromkeys(("main_cpu", "main_wait", "others_cpu", "others_wait"), 0.0)
    for task in Path("/proc/self/task").iterdir():
        try:
            on_cpu, waited = Path(task, "schedstat").read_text().split()[:2]
        except OSError:  # the thread ended in between
            continue
        who = "main" if int(task.name) == main else "others"
        out[f"{who}_cpu"] += int(on_cpu) / 1e9
        out[f"{who}_wait"] += int(waited) / 1e9
    out["process_cpu"] = time.process_time()
    return out


class Engine:
    """A copy of the workload's model, trained by one engine with the caps asked for."""

    def __init__(self, kind: str, name: str, args: argparse.Namespace) -> None:
        self.kind, self.work = kind, WORKLOADS[name]
        model = build(name)
        caps = {"bucket_cap_mb": args.bucket_mb}
        if kind.startswith("lockstep"):
            nonfinite = "off" if kind == "lockstep_nocheck" else "raise"
            model = lockstep.DistributedDataParallel(
                model, first_bucket_cap_mb=args.first_bucket_mb, nonfinite=nonfinite, **caps
            )
            if kind == "lockstep_nofp":  # a world of one makes the fingerprint a no-op
                group_rank = dist.get_rank()
                model.reducer.driver.fingerprint = StepFingerprint(None, group_rank, 1)
        elif kind == "torch":
            # torch's first bucket is 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), not settable
            model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, **caps)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        out = self.model(batch[0])
        t1 = time.perf_counter()
        self.work.loss(out, batch[1]).backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        return {"step": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}

    def timeline(self) -> dict | None:
        """lockstep's last step as its engine saw it (None for the others)."""
        if not self.kind.startswith("lockstep"):
            return None
        stats = self.model.reducer.driver.last_stats
        if stats is None:
            return None
        return {
            "exposed": stats.exposed_seconds,
            "forward": stats.forward_seconds,
            "buckets": [
                (b.index, b.nbytes, b.num_params, b.ready, b.launched, b.done)
                for b in stats.buckets
            ],
        }


def _turn(engine: Engine, batch: tuple, steps: int, main: int) -> list[dict]:
    dist.barrier()
    rows = []
    for _ in range(steps):
        before = thread_times(main)
        row = engine.step(batch)
        after = thread_times(main)
        row.update({k: after[k] - before[k] for k in THREADS})
        timeline = engine.timeline()
        if timeline is not None:
            row["timeline"] = timeline
        rows.append(row)
    return rows


def _profiled(engine: Engine, batch: tuple, args: argparse.Namespace, label: str) -> str:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step(batch)
    args.profile.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.profile / f"{label}_rank{dist.get_rank()}.json"))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def _measure(ctx: lockstep.DistContext, name: str, args: argparse.Namespace) -> dict:
    main = threading.get_native_id()
    engines = {kind: Engine(kind, name, args) for kind in ENGINES}
    batch = WORKLOADS[name].batch(torch.Generator().manual_seed(100 + ctx.rank))
    for engine in engines.values():
        _turn(engine, batch, 3, main)  # warm-up: lockstep rebuilds its buckets after step 1
    rows: dict[str, list[dict]] = {k: [] for k in ENGINES}
    for rep in range(args.reps):
        for kind in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            rows[kind] += _turn(engines[kind], batch, args.steps, main)
    tables = {}
    if args.profile is not None:
        for kind in ("lockstep", "torch"):
            label = f"{name}_{kind}_ws{ctx.world_size}"
            tables[kind] = _profiled(engines[kind], batch, args, label)
    return {"rows": rows, "profile": tables}


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: _measure(ctx, name, args) for name in args.workloads}


def _ms(rows: list[dict], key: str) -> float:
    return 1e3 * statistics.median(r[key] for r in rows)


def report(name: str, result: dict) -> str:
    """Rank 0's figures for one workload: phases, threads, lockstep's timeline."""
    rows = result["rows"]
    lines = [
        f"### {name}",
        "| engine | " + " | ".join(f"{p} ms" for p in PHASES) + " | main cpu / run-queue ms "
        "| other threads cpu / run-queue ms | process cpu ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in ENGINES:
        r = rows[kind]
        phases = " | ".join(f"{_ms(r, p):.1f}" for p in PHASES)
        lines.append(
            f"| {kind} | {phases} | {_ms(r, 'main_cpu'):.1f} / {_ms(r, 'main_wait'):.1f} | "
            f"{_ms(r, 'others_cpu'):.1f} / {_ms(r, 'others_wait'):.1f} | "
            f"{_ms(r, 'process_cpu'):.1f} |"
        )
    timelines = [r["timeline"] for r in rows["lockstep"] if "timeline" in r]
    if timelines:
        exposed = 1e3 * statistics.median(t["exposed"] for t in timelines)
        lines += [
            "",
            f"lockstep's timeline (median over steps, ms from the forward's start; "
            f"backward waited {exposed:.1f} ms for communication after autograd ended):",
            "| bucket | MB | params | ready | launched | done | all-reduce ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for position, bucket in enumerate(timelines[0]["buckets"]):
            index, nbytes, params = bucket[:3]
            ready, launched, done = (
                1e3 * statistics.median(t["buckets"][position][k] for t in timelines)
                for k in (3, 4, 5)
            )
            lines.append(
                f"| {index} | {nbytes / 1e6:.2f} | {params} | {ready:.1f} | {launched:.1f} | "
                f"{done:.1f} | {done - launched:.1f} |"
            )
    for kind, table in result["profile"].items():
        lines += ["", f"{kind}: rank 0's ops by self CPU time (torch.profiler)", "", table]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="steps per turn")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--first-bucket-mb", type=float, default=1.0, help="lockstep's only")
    parser.add_argument("--profile", type=Path, help="also profile one turn; traces here")
    parser.add_argument("--json", type=Path, help="also write every rank's rows here")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    load = Path("/proc/loadavg").read_text().split()[:3]
    results = run_ranks(rank_main, args.world_size, args, deadline_s=3600, timeout_s=600)
    print(
        f"world size {args.world_size} on {os.cpu_count()} cores, load average at start "
        f"{' '.join(load)}; rank 0, medians over {args.reps} x {args.steps} steps per engine\n"
    )
    for name in args.workloads:
        print(report(name, results[0][name]) + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
