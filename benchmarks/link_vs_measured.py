"""The planner's predicted all-reduce time per step against the time the engine really spends.

    python benchmarks/link_vs_measured.py                      # world size 2, gloo/CPU
    python benchmarks/link_vs_measured.py --reps 8 --steps 10
    python benchmarks/link_vs_measured.py --bandwidth-from bw.json   # a saved bench result

In one job of N ranks, repeated `--reps` times, interleaved so that drifting load
on the machine hits both sides alike:
1. Measure the engine: train each workload under lockstep.DistributedDataParallel
   and read `ddp.stats` after every step: `comm_seconds` (launch-to-done of every
   bucket's all-reduce, summed), and each bucket's launch and completion times.
2. Measure the link: the all-reduce sweep of `lockstep bench allreduce` (its own
   code, in the same ranks), fitted to a bus bandwidth and a latency.
3. Predict: the workload's model, counted on the meta device, planned at world size
   N on that measured link: the sum over DDP's buckets of 2(N-1) x hop latency +
   2(N-1)/N x bucket / busbw. Compare per repetition; report the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.bench.allreduce_worker import SweepOptions, run_sweep
from lockstep.bench.sweep import result_json, sweep_sizes
from lockstep.plan import PlanConfig, count_on_meta, full_trainable, make_plan
from lockstep.plan.comm import ring_seconds
from lockstep.plan.links import Link, measured_from_doc, read_measured
from lockstep.plan.units import DType
from lockstep.testing import run_ranks

SWEEP = SweepOptions(tuple(sweep_sizes(4096, 64 * 2**20, 2, 4)), "fp32", iters=5, warmup=1)


def predict(name: str, world: int, link: Link) -> tuple[float, int, list[float]]:
    """(predicted seconds per step, payload bytes, predicted seconds per bucket)."""
    shape = count_on_meta(WORKLOADS[name].factory, name)
    cfg = PlanConfig(
        shape, full_trainable(shape), gpus=world, weights_dtype=DType.FP32, measured=link
    )
    plan = make_plan(cfg)
    row = next(r for r in plan.comm if r.label == "measured")
    per_bucket = [ring_seconds(b, world, link.low_bps, link.hop_latency_s) for b in plan.buckets]
    return row.seconds_fast, plan.payload_bytes, per_bucket


def _train(ctx, ddp, opt, name: str, gen: torch.Generator, steps: int) -> dict:
    workload, comm, spans = WORKLOADS[name], [], []
    for _ in range(steps):
        inputs, targets = workload.batch(gen)
        workload.loss(ddp(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = ddp.stats
        comm.append(stats.comm_seconds)
        # perf_counter is CLOCK_MONOTONIC: comparable across processes on one machine
        spans.append([(stats.start + b.launched, stats.start + b.done) for b in stats.buckets])
    return {"comm_s": comm, "spans": spans, "buckets": len(stats.buckets)}


def rank_main(ctx: lockstep.DistContext, names: list[str], args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    runs = {}
    for name in names:
        ddp = lockstep.DistributedDataParallel(build(name))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        _train(ctx, ddp, opt, name, gen, args.warmup)
        runs[name] = (ddp, opt, gen)
    reps = []
    for _ in range(args.reps):
        rep = {
            name: _train(ctx, *runs[name][:2], name, runs[name][2], args.steps) for name in names
        }
        if args.bandwidth_from is None:
            rep["sweep"] = result_json(run_sweep(ctx, SWEEP), ctx.world_size, {})
        reps.append(rep)
    payloads = {name: runs[name][0].payload_bytes for name in names}
    return {"reps": reps, "payload_bytes": payloads}


def busy_per_bucket(per_rank_spans: list[list[tuple[float, float]]]) -> list[float]:
    """One step's all-reduce time per bucket once every rank had launched it, in series.

    Bucket i counts from the later of (the last rank's launch, bucket i-1 done everywhere)
    to its completion on the last rank: waiting for a slower peer's backward is left out.
    """
    busy, previous_done = [], float("-inf")
    for bucket in zip(*per_rank_spans, strict=True):
        launched = max(launch for launch, _ in bucket)
        done = max(d for _, d in bucket)
        busy.append(done - max(launched, previous_done))
        previous_done = done
    return busy


def _rep(results: list[dict], i: int, name: str) -> tuple[float, list[float]]:
    """Repetition i: (engine comm_seconds, busy seconds per bucket), medians over steps."""
    comm = statistics.mean(statistics.median(r["reps"][i][name]["comm_s"]) for r in results)
    steps = zip(*(r["reps"][i][name]["spans"] for r in results), strict=True)
    per_step = [busy_per_bucket(list(step)) for step in steps]
    return comm, [statistics.median(col) for col in zip(*per_step, strict=True)]


def summarize(results: list[dict], name: str, world: int, fixed: Link | None) -> dict:
    """Per repetition: prediction from that repetition's sweep against the engine's figures."""
    pred, comm, busy, bucket_ratios, bw = [], [], [], [], []
    for i, rep0 in enumerate(results[0]["reps"]):
        link = fixed or measured_from_doc(rep0["sweep"], "sweep")
        seconds, payload, per_bucket = predict(name, world, link)
        c, b = _rep(results, i, name)
        pred.append(seconds)
        comm.append(c)
        busy.append(sum(b))
        bucket_ratios.append([m / p for m, p in zip(b, per_bucket, strict=True)])
        bw.append(link.low_bps)
    assert results[0]["payload_bytes"][name] == payload, "planner and engine payloads differ"
    return {
        "name": name,
        "payload_bytes": payload,
        "buckets": f"{len(per_bucket)} / {results[0]['reps'][0][name]['buckets']}",
        "busbw_GBps": statistics.median(bw) / 1e9,
        "predicted_ms": 1e3 * statistics.median(pred),
        "comm_ms": 1e3 * statistics.median(comm),
        "busy_ms": 1e3 * statistics.median(busy),
        "comm_ratio": _spread([c / p for c, p in zip(comm, pred, strict=True)]),
        "busy_ratio": _spread([b / p for b, p in zip(busy, pred, strict=True)]),
        "bucket_busy_ratio": [statistics.median(col) for col in zip(*bucket_ratios, strict=True)],
    }


def _spread(values: list[float]) -> list[float]:
    """[median, min, max]."""
    return [statistics.median(values), min(values), max(values)]


def table(rows: list[dict]) -> str:
    lines = [
        "| workload | payload (MB) | buckets plan / engine | busbw (GB/s) | predicted (ms) "
        "| engine comm_seconds (ms) | ratio median (min-max) | busy after last launch (ms) "
        "| ratio median (min-max) | busy / predicted per bucket, launch order |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cr, br = r["comm_ratio"], r["busy_ratio"]
        lines.append(
            f"| {r['name']} | {r['payload_bytes'] / 1e6:.2f} | {r['buckets']} | "
            f"{r['busbw_GBps']:.3f} | {r['predicted_ms']:.2f} | {r['comm_ms']:.2f} | "
            f"{cr[0]:.2f} ({cr[1]:.2f}-{cr[2]:.2f}) | {r['busy_ms']:.2f} | "
            f"{br[0]:.2f} ({br[1]:.2f}-{br[2]:.2f}) | "
            f"{', '.join(f'{x:.2f}' for x in r['bucket_busy_ratio'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--steps", type=int, default=10, help="engine steps per repetition")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bandwidth-from", default=None, help="use this bench result instead")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = args.workloads.split(",")
    fixed = read_measured(args.bandwidth_from) if args.bandwidth_from else None
    results = run_ranks(rank_main, args.world_size, names, args, deadline_s=3600, timeout_s=300)
    rows = [summarize(results, name, args.world_size, fixed) for name in names]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
