"""The planner's predicted all-reduce time per step against the time the engine really spends.

    python benchmarks/plan_vs_measured.py                      # world size 2, gloo/CPU
    python benchmarks/plan_vs_measured.py --steps 30 --bandwidth-from bw.json

1. Measure: `lockstep bench allreduce --nproc-per-node N --json` (launched like
   training), unless --bandwidth-from names a saved result. The sweep's fit gives a
   bus bandwidth and a latency.
2. Predict: each workload's model is counted on the meta device and planned at
   world size N with that measured link: the sum over DDP's buckets of
   2(N-1) x hop latency + 2(N-1)/N x bucket / busbw.
3. Measure the engine: train each workload under lockstep.DistributedDataParallel at
   world size N and read `ddp.stats.comm_seconds` (launch-to-done of every bucket's
   all-reduce, summed) after every step; the median over steps, averaged over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.plan import PlanConfig, count_module, full_trainable, make_plan
from lockstep.plan.links import read_measured
from lockstep.plan.units import DType
from lockstep.testing import run_ranks


def measure_bandwidth(world: int, path: Path, max_bytes: str) -> None:
    """Run the all-reduce bench through lockstep's launcher; it writes `path`."""
    cmd = [
        sys.executable,
        "-m",
        "lockstep.cli",
        "bench",
        "allreduce",
        "--nproc-per-node",
        str(world),
        "--min-bytes",
        "4KiB",
        "--max-bytes",
        max_bytes,
        "--iters",
        "10",
        "--json",
        str(path),
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code != 0:
        raise SystemExit(f"the bench failed with exit code {code}")


def predict(name: str, world: int, link) -> tuple[float, int, int]:
    """(predicted seconds per step, payload bytes, bucket count) from the planner."""
    with torch.device("meta"):
        shape = count_module(WORKLOADS[name].factory(), name)
    cfg = PlanConfig(
        shape, full_trainable(shape), gpus=world, weights_dtype=DType.FP32, measured=link
    )
    plan = make_plan(cfg)
    row = next(r for r in plan.comm if r.label == "measured")
    return row.seconds_fast, plan.payload_bytes, len(plan.buckets)


def rank_main(ctx: lockstep.DistContext, names: list[str], steps: int, warmup: int) -> dict:
    out = {}
    for name in names:
        workload = WORKLOADS[name]
        ddp = lockstep.DistributedDataParallel(build(name))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        comm, spans = [], []
        for step in range(warmup + steps):
            inputs, targets = workload.batch(gen)
            workload.loss(ddp(inputs), targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= warmup:
                stats = ddp.stats
                comm.append(stats.comm_seconds)
                # perf_counter is CLOCK_MONOTONIC: comparable across processes on one machine
                spans.append(
                    [(stats.start + b.launched, stats.start + b.done) for b in stats.buckets]
                )
        out[name] = {
            "comm_s": comm,
            "spans": spans,
            "payload_bytes": ddp.stats.payload_bytes,
            "buckets": len(ddp.stats.buckets),
        }
    return out


def busy_seconds(per_rank_spans: list[list[tuple[float, float]]]) -> float:
    """One step's all-reduce time once every rank had launched each bucket, buckets in series.

    Bucket i counts from the later of (the last rank's launch, bucket i-1 done everywhere)
    to its completion on the last rank: waiting for a slower peer's backward is left out.
    """
    total, previous_done = 0.0, float("-inf")
    for bucket in zip(*per_rank_spans, strict=True):
        launched = max(launch for launch, _ in bucket)
        done = max(d for _, d in bucket)
        total += done - max(launched, previous_done)
        previous_done = done
    return total


def measured(results: list[dict], name: str) -> tuple[float, float]:
    """(engine comm_seconds, median over steps and mean over ranks; busy time, median)."""
    comm = statistics.mean(statistics.median(r[name]["comm_s"]) for r in results)
    steps = zip(*(r[name]["spans"] for r in results), strict=True)
    busy = statistics.median(busy_seconds(list(step)) for step in steps)
    return comm, busy


def table(rows: list[dict], link, world: int) -> str:
    lines = [
        f"measured link: busbw {link.low_bps / 1e9:.3f} GB/s, {link.hop_latency_s * 1e6:.0f} us "
        f"per ring hop (fitted over the sweep); world size {world}",
        "",
        "| workload | payload (MB) | buckets plan / engine | predicted (ms) | engine comm_seconds"
        " (ms) | ratio | all-reduce busy after last launch (ms) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = r["predicted_s"]
        lines.append(
            f"| {r['name']} | {r['payload_bytes'] / 1e6:.2f} | {r['plan_buckets']} / "
            f"{r['engine_buckets']} | {1e3 * pred:.2f} | {1e3 * r['comm_s']:.2f} | "
            f"{r['comm_s'] / pred:.2f} | {1e3 * r['busy_s']:.2f} | {r['busy_s'] / pred:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bandwidth-from", type=Path, default=None)
    parser.add_argument("--max-bytes", default="64MiB", help="largest size of the bench sweep")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.bandwidth_from or Path(tmp) / "bw.json"
        if args.bandwidth_from is None:
            measure_bandwidth(args.world_size, path, args.max_bytes)
        link = read_measured(str(path))
    results = run_ranks(
        rank_main, args.world_size, names, args.steps, args.warmup, deadline_s=1800, timeout_s=300
    )
    rows = []
    for name in names:
        predicted, payload, plan_buckets = predict(name, args.world_size, link)
        assert results[0][name]["payload_bytes"] == payload, "planner and engine payloads differ"
        comm, busy = measured(results, name)
        rows.append(
            {
                "name": name,
                "payload_bytes": payload,
                "plan_buckets": plan_buckets,
                "engine_buckets": results[0][name]["buckets"],
                "predicted_s": predicted,
                "comm_s": comm,
                "busy_s": busy,
            }
        )
    print(table(rows, link, args.world_size))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
