"""The sharded engine against lockstep DDP and torch FSDP2, side by side in one run (gloo/CPU).

    python benchmarks/sharded_vs_ddp.py                          # world sizes 2 and 4
    python benchmarks/sharded_vs_ddp.py --world-sizes 2 --reps 4 --steps-per-rep 3
    sudo PYTHONPATH=src python benchmarks/sharded_vs_ddp.py --own-netns   # + loopback counter

Every engine wraps its own copy of the same small GPT (gpt-5m of workloads.py;
stage 3 and FSDP2 unit = one transformer block) and trains with AdamW in
alternating phases (A..E then E..A, so drift hits all), one thread per rank.
Reported per engine: memory of the model states on rank 0 after a step, counted
from tensor storages, next to `lockstep plan`'s prediction; bytes each rank
really sent per step (/proc/self/io wchar, which counts socket writes) against
the theory (DDP 2(N-1)/N x G; stage 1 adds an all-gather, 3(N-1)/N x G; stage 2
2(N-1)/N x G; stage 3 (N-1)/N x (G + 2 x G_units + G_root), the root unit being
gathered once; FSDP2 is held to stage 3's theory); with `--own-netns` (root) the
run has a network namespace of its own and the loopback interface's tx counter
(/proc/self/net/dev, every rank's bytes, TCP/IP headers included) gives a second,
independent measure; median step time and its ratio to lockstep DDP and FSDP2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, _Block, build

import lockstep
from lockstep.plan.measured import measured_bytes, planned_bytes
from lockstep.testing import run_ranks
from lockstep.testing.mesh import device_mesh

ENGINES = ("ddp", "stage1", "stage2", "stage3", "fsdp2")
NAME = "gpt-5m"
THEORY = {"ddp": 2, "stage1": 3, "stage2": 2}  # x (N-1)/N x gradient bytes
NET_DEV = Path("/proc/self/net/dev")  # this process's network namespace (sysfs is the host's)


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _loopback() -> int:
    """Bytes sent so far on the loopback interface of this process's network namespace."""
    for line in NET_DEV.read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])  # receive: 8 fields, then transmit bytes
    return 0


def _stage3_factor(model: torch.nn.Module) -> float:
    """Stage 3's bytes in units of (N-1)/N x G: reduce-scatter 1, blocks gathered twice,
    the root (embeddings, final norm, head) once."""
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.blocks.parameters())
    return (total + 2 * blocks + (total - blocks)) / total


def _wrap(engine: str) -> torch.nn.Module:
    model = build(NAME)
    if engine == "ddp":
        return lockstep.DDP(model)
    if engine == "fsdp2":  # an explicit mesh: the accelerator's would not fit a CPU model
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh("cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    stage = int(engine.removeprefix("stage"))
    return lockstep.ShardedDataParallel(model, stage=stage, wrap=[_Block] if stage == 3 else None)


class Runner:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.model = _wrap(engine)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, int]:
        start, sent = time.perf_counter(), _wchar()
        WORKLOADS[NAME].loss(self.model(batch[0]), batch[1]).backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start, _wchar() - sent

    def memory(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        """State bytes after a step, before zero_grad (everything held at once)."""
        WORKLOADS[NAME].loss(self.model(batch[0]), batch[1]).backward()
        self.opt.step()
        got = measured_bytes(self.model, self.opt)
        self.opt.zero_grad()
        return {"weights": got.weights, "grads": got.grads, "optimizer": got.optimizer}


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    batches = [WORKLOADS[NAME].batch(gen) for _ in range(4)]
    runners = {e: Runner(e) for e in ENGINES}
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    sent: dict[str, list[int]] = {e: [] for e in ENGINES}
    loop: dict[str, list[int]] = {e: [] for e in ENGINES}
    for runner in runners.values():
        for batch in batches[: args.warmup]:
            runner.step(batch)
    for rep in range(args.reps):
        for engine in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            dist.barrier()
            before = _loopback()
            dist.barrier()  # no rank starts the phase before rank 0 has read the counter
            for i in range(args.steps_per_rep):
                seconds, nbytes = runners[engine].step(batches[i % len(batches)])
                times[engine].append(seconds)
                sent[engine].append(nbytes)
            dist.barrier()  # every rank's bytes of the phase are in the counter
            loop[engine].append(_loopback() - before)
    memory = {e: runners[e].memory(batches[0]) for e in ENGINES if e != "fsdp2"}
    plain = build(NAME)
    planned = {}
    for engine in memory:
        p = planned_bytes(plain, ctx.world_size, 0 if engine == "ddp" else int(engine[-1]))
        planned[engine] = {"weights": p.weights, "grads": p.grads, "optimizer": p.optimizer}
    grad_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    steps = args.steps_per_rep * ctx.world_size  # per rank per step
    per_step = {e: [b / steps for b in v] for e, v in loop.items()}
    return {
        "times": times,
        "sent": sent,
        "loopback": per_step,
        "memory": memory,
        "planned": planned,
        "G": grad_bytes,
        "stage3": _stage3_factor(plain),
    }


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def memory_table(raw: dict, world: int) -> list[str]:
    lines = [
        f"memory per rank, N = {world} (MB = 1e6 bytes; measured / planned)",
        "| engine | weights | gradients | optimizer | total | measured / planned |",
        "|---|---|---|---|---|---|",
    ]
    for engine, got in raw["memory"].items():
        want = raw["planned"][engine]
        cells = " | ".join(f"{_mb(got[k])} / {_mb(want[k])}" for k in got)
        total, plan = sum(got.values()), sum(want.values())
        lines.append(f"| {engine} | {cells} | {_mb(total)} / {_mb(plan)} | {total / plan:.3f} |")
    return lines


def comm_table(raw: dict, world: int) -> list[str]:
    med = {e: statistics.median(v) for e, v in raw["times"].items()}
    lines = [
        f"per step, N = {world} (sent: MB per rank per step, median; theory k(N-1)/N x G; "
        "lo: loopback counter, all ranks / N, only meaningful with --own-netns)",
        "| engine | sent | theory | sent / theory | lo / theory | ms/step | vs DDP | vs FSDP2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for engine in ENGINES:
        sent = statistics.median(raw["sent"][engine])
        lo = statistics.median(raw["loopback"][engine])
        theory = THEORY.get(engine, raw["stage3"]) * (world - 1) / world * raw["G"]
        lines.append(
            f"| {engine} | {_mb(sent)} | {_mb(theory)} | {sent / theory:.3f} | "
            f"{lo / theory:.3f} | "
            f"{1e3 * med[engine]:.0f} | {med[engine] / med['ddp']:.2f} | "
            f"{med[engine] / med['fsdp2']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps-per-rep", type=int, default=3)
    parser.add_argument("--own-netns", action="store_true", help="rerun in a new netns (root)")
    args = parser.parse_args()
    if args.own_netns and not os.environ.get("LOCKSTEP_BENCH_OWN_NETNS"):
        os.environ["LOCKSTEP_BENCH_OWN_NETNS"] = "1"
        argv = " ".join([sys.executable, *sys.argv])
        os.execvp("unshare", ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {argv}"])
    for world in map(int, args.world_sizes.split(",")):
        raw = run_ranks(rank_main, world, args, deadline_s=3600, timeout_s=600)[0]
        print("\n".join([*memory_table(raw, world), "", *comm_table(raw, world), ""]))


if __name__ == "__main__":
    main()
