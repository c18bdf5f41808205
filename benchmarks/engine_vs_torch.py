"""lockstep's engine against torch DDP, side by side in one process group, on gloo/CPU.

    python benchmarks/engine_vs_torch.py                       # world size 2, all workloads
    python benchmarks/engine_vs_torch.py --world-sizes 2,4 --reps 6 --steps-per-rep 5
    python benchmarks/engine_vs_torch.py --variant static_graph  # both: static_graph=True
    python benchmarks/engine_vs_torch.py --variant toggle_sync   # 2 micro-batches a step,
                                                   # require_backward_grad_sync toggled
    python benchmarks/engine_vs_torch.py --world-sizes 4 --reps 2 --profile runs/prof
                                                   # + a timeline of each engine's step

Both engines wrap copies of the same model with the same bucket arguments
(25 MiB buckets, 1 MiB first bucket, gradients as bucket views) and train in
alternating phases (A/B then B/A, so drift hits both), one thread per rank.
Reported per workload: the step-time ratio lockstep/torch (median, min, max over
repetitions); overlap, (T_after - T) / (T_after - T_nocomm), where T_after is a
step that all-reduces one flat buffer after backward and T_nocomm a step with no
communication; bytes each rank really sent per step (/proc/self/io wchar, which
counts socket writes) against the ring figure 2(N-1)/N x gradient bytes; and
per-gradient-tensor overhead at world size 1, (T_engine - T_plain) / tensors; and
the cost of the step fingerprint: lockstep with it (the default) over lockstep
with it switched off, in the same alternating phases ("fp on/off" column); and the
cost of the non-finite check (`runtime/finite.py`): the default over nonfinite="off"
("finite on/off" column). `--profile DIR` adds, after the timed phases, one phase
of each engine under torch.profiler: DIR/<workload>_<engine>_ws<N>_rank<r>.json, a
Chrome trace (chrome://tracing, ui.perfetto.dev) with backward's kernels, the hooks
and gloo's collectives on their threads: where a step's time goes, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, build

import lockstep
from lockstep.runtime.fingerprint import StepFingerprint
from lockstep.runtime.step_stats import ring_wire_bytes
from lockstep.testing import run_ranks


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


class Runner:
    """One way of training a copy of the workload's model: ours, torch, plain or after."""

    def __init__(
        self, kind: str, name: str, group: dist.ProcessGroup | None, variant: str = "default"
    ) -> None:
        self.kind, self.workload = kind, WORKLOADS[name]
        self.model = build(name)
        self.group = group
        self.micro = 2 if variant == "toggle_sync" else 1
        extra = {"static_graph": True} if variant == "static_graph" else {}
        if kind == "lockstep_nocheck":
            extra = {**extra, "nonfinite": "off"}
        if kind in ("lockstep", "lockstep_nofp", "lockstep_nocheck"):
            self.model = lockstep.DistributedDataParallel(self.model, process_group=group, **extra)
        if kind == "lockstep_nofp":  # a world of one makes the fingerprint a no-op
            self.model.reducer.driver.fingerprint = StepFingerprint(group, dist.get_rank(group), 1)
        elif kind == "torch":
            self.model = nn.parallel.DistributedDataParallel(
                self.model, process_group=group, gradient_as_bucket_view=True, **extra
            )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def _forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.micro == 1:
            self.workload.loss(self.model(batch[0]), batch[1]).backward()
            return
        for k in range(self.micro):  # the attribute, as training loops toggle it
            if self.kind in ("lockstep", "lockstep_nofp", "lockstep_nocheck", "torch"):
                self.model.require_backward_grad_sync = k == self.micro - 1
            self.workload.loss(self.model(batch[0]), batch[1]).backward()

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, int]:
        start, sent = time.perf_counter(), _wchar()
        self.opt.zero_grad()
        self._forward_backward(batch)
        if self.kind == "after":
            grads = [p.grad for p in self.model.parameters()]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.group)
            for grad, value in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                grad.copy_(value)
        self.opt.step()
        return time.perf_counter() - start, _wchar() - sent


def _phase(runner: Runner, batches: list, steps: int) -> tuple[list[float], list[int]]:
    dist.barrier()
    times, sent = [], []
    for i in range(steps):
        seconds, nbytes = runner.step(batches[i % len(batches)])
        times.append(seconds)
        sent.append(nbytes)
    return times, sent


def _own_group(ctx: lockstep.DistContext) -> dist.ProcessGroup:
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    return groups[ctx.rank]


def _measure(ctx: lockstep.DistContext, name: str, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    batches = [WORKLOADS[name].batch(gen) for _ in range(4)]
    solo = _own_group(ctx)
    v = args.variant
    runners = {
        "lockstep": Runner("lockstep", name, None, v),
        "lockstep_nofp": Runner("lockstep_nofp", name, None, v),
        "lockstep_nocheck": Runner("lockstep_nocheck", name, None, v),
        "torch": Runner("torch", name, None, v),
        "plain": Runner("plain", name, None, v),
        "after": Runner("after", name, None, v),
        "lockstep_ws1": Runner("lockstep", name, solo, v),
        "torch_ws1": Runner("torch", name, solo, v),
    }
    times: dict[str, list[list[float]]] = {k: [] for k in runners}
    sent: dict[str, list[int]] = {k: [] for k in runners}
    for runner in runners.values():
        _phase(runner, batches, args.warmup)
    order = list(runners)
    for rep in range(args.reps):
        for kind in order if rep % 2 == 0 else order[::-1]:
            t, s = _phase(runners[kind], batches, args.steps_per_rep)
            times[kind].append(t)
            sent[kind].extend(s)
    if args.profile is not None:
        for kind in ("lockstep", "torch"):
            _profiled(runners[kind], batches, args, f"{name}_{kind}_ws{ctx.world_size}")
    params = list(runners["plain"].model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"times": times, "sent": sent, "grad_bytes": grad_bytes, "tensors": len(params)}


def _profiled(runner: Runner, batches: list, args: argparse.Namespace, label: str) -> None:
    """One phase under torch.profiler; its Chrome trace, one file per rank."""
    args.profile.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _phase(runner, batches, args.steps_per_rep)
    prof.export_chrome_trace(str(args.profile / f"{label}_rank{dist.get_rank()}.json"))


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: _measure(ctx, name, args) for name in args.workloads}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(raw: dict, world: int) -> dict:
    """Turn rank 0's raw timings into the reported figures."""
    times = raw["times"]
    med = {k: _median([t for rep in v for t in rep]) for k, v in times.items()}
    ratios = [
        _median(a) / _median(b) for a, b in zip(times["lockstep"], times["torch"], strict=True)
    ]
    fp_ratios = [
        _median(a) / _median(b)
        for a, b in zip(times["lockstep"], times["lockstep_nofp"], strict=True)
    ]
    check_ratios = [
        _median(a) / _median(b)
        for a, b in zip(times["lockstep"], times["lockstep_nocheck"], strict=True)
    ]
    span = med["after"] - med["plain"]
    overlap = {
        k: (med["after"] - med[k]) / span if span > 0 else float("nan")
        for k in ("lockstep", "torch")
    }
    return {
        "world_size": world,
        "ratio_median": _median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "fingerprint_ratio": (_median(fp_ratios), min(fp_ratios), max(fp_ratios)),
        "finite_ratio": (_median(check_ratios), min(check_ratios), max(check_ratios)),
        "ms": {k: 1e3 * v for k, v in med.items()},
        "overlap": overlap,
        "sent_per_step": {k: _median(raw["sent"][k]) for k in ("lockstep", "torch")},
        "ring_bytes": ring_wire_bytes(raw["grad_bytes"], world),
        "us_per_tensor": {
            k: 1e6 * (med[f"{k}_ws1"] - med["plain"]) / raw["tensors"]
            for k in ("lockstep", "torch")
        },
    }


def table(rows: dict) -> str:
    lines = [
        "| workload | N | ratio median (min-max) | ms/step lockstep / torch / no comm / after bwd"
        " | overlap lockstep / torch | MB sent/step lockstep / torch / ring | us/tensor lockstep"
        " / torch | fp on/off median (min-max) | finite on/off median (min-max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, world), r in rows.items():
        ms, ov, sent = r["ms"], r["overlap"], r["sent_per_step"]
        fp, fin = r["fingerprint_ratio"], r["finite_ratio"]
        lines.append(
            f"| {name} | {world} | {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-"
            f"{r['ratio_max']:.3f}) | {ms['lockstep']:.1f} / {ms['torch']:.1f} / "
            f"{ms['plain']:.1f} / {ms['after']:.1f} | {ov['lockstep']:.0%} / {ov['torch']:.0%} | "
            f"{sent['lockstep'] / 1e6:.2f} / {sent['torch'] / 1e6:.2f} / "
            f"{r['ring_bytes'] / 1e6:.2f} | {r['us_per_tensor']['lockstep']:.1f} / "
            f"{r['us_per_tensor']['torch']:.1f} | {fp[0]:.3f} ({fp[1]:.3f}-{fp[2]:.3f}) | "
            f"{fin[0]:.3f} ({fin[1]:.3f}-{fin[2]:.3f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps-per-rep", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--profile", type=Path, help="also write each engine's timeline here")
    parser.add_argument(
        "--variant",
        choices=("default", "static_graph", "toggle_sync"),
        default="default",
        help="static_graph=True in both wrappers, or 2 micro-batches per step with "
        "require_backward_grad_sync toggled",
    )
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    rows = {}
    for world in map(int, args.world_sizes.split(",")):
        results = run_ranks(rank_main, world, args, deadline_s=3600, timeout_s=600)
        for name in args.workloads:
            rows[(name, world)] = summarize(results[0][name], world)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({f"{n}@{w}": r for (n, w), r in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
