"""One worker of the topology experiment (benchmarks/collectives_topology.py), under `lockstep run`.

    lockstep run --nnodes 2 ... benchmarks/collectives_topology_worker.py allreduce \
        --algorithms ring,hierarchical,native --size 25MB --iters 8 --iface veth0 --out DIR
    lockstep run --nnodes 2 ... benchmarks/collectives_topology_worker.py train \
        --steps 12 --out DIR --label train-2x2

`allreduce`: each algorithm in turn (blocks ABC then CBA), every call behind a
barrier; the slowest rank's time per call; and, read on each node's local rank 0,
the bytes its inter-node interface sent and received during the block.
`train`: the small GPT of benchmarks/workloads.py, fully trainable and with LoRA
adapters (rank 8 on every Linear of the blocks, everything else frozen), each in
lockstep.DistributedDataParallel, one step of each in turn; the median step time
(slowest rank) of each is kept.
"""

from __future__ import annotations

import argparse
import json
import math
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
from lockstep.bench.timing import per_call_seconds, slowest
from lockstep.collectives import make_allreduce


def _counters(iface: str | None) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of `iface` in this network namespace; zeros without one."""
    if not iface:
        return 0, 0
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _block(fn, tensor: torch.Tensor, iters: int, iface: str | None) -> dict:
    fn(tensor)  # warm-up: connections, buffers
    dist.barrier()
    tx0, rx0 = _counters(iface)
    times = per_call_seconds({"call": lambda: fn(tensor)}, iters, warmup=0)["call"]
    dist.barrier()
    tx1, rx1 = _counters(iface)
    return {"times": times, "tx": (tx1 - tx0) / iters, "rx": (rx1 - rx0) / iters}


def run_allreduce(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    """Time each algorithm and count the inter-node bytes per call, per node."""
    names = args.algorithms.split(",")
    fns = {name: make_allreduce(name, None, ctx.local_world_size) for name in names}
    tensor = torch.zeros(args.size // 4)
    blocks: dict[str, list[dict]] = {name: [] for name in names}
    for order in (names, names[::-1]):
        for name in order:
            blocks[name].append(_block(fns[name], tensor, args.iters, args.iface))
    result = {}
    for name, runs in blocks.items():
        per_node = [None] * ctx.world_size
        dist.all_gather_object(per_node, [(r["tx"], r["rx"]) for r in runs])
        leaders = per_node[:: ctx.local_world_size]  # local rank 0 of each node read them
        result[name] = {
            "median_s": statistics.median(t for r in runs for t in r["times"]),
            "tx_bytes_per_call_by_node": [statistics.mean(tx for tx, _ in n) for n in leaders],
            "rx_bytes_per_call_by_node": [statistics.mean(rx for _, rx in n) for n in leaders],
        }
    return result


class LoRALinear(nn.Module):
    """y = base(x) + (x A^T B^T) * alpha / r, with `base` frozen and B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.down.t() @ self.up.t()) * self.scale


def build_model(mode: str) -> nn.Module:
    """The small GPT, fully trainable ("full") or frozen with LoRA adapters ("lora")."""
    model = build("gpt-5m")
    if mode == "lora":
        model.requires_grad_(False)
        torch.manual_seed(1)
        for block in model.blocks:
            for name in ("qkv", "proj", "fc", "fc_out"):
                setattr(block, name, LoRALinear(getattr(block, name)))
    return model


def run_train(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    """Median step time (slowest rank) of the small GPT, full and LoRA, steps alternating.

    Both models train in the same job, one step of each in turn, so a change in the
    machine's load hits both alike.
    """
    workload = WORKLOADS["gpt-5m"]
    runs = {}
    for mode in ("full", "lora"):
        model = build_model(mode)
        ddp = lockstep.DistributedDataParallel(model, allreduce=args.allreduce)
        params = [p for p in model.parameters() if p.requires_grad]
        runs[mode] = (ddp, torch.optim.SGD(params, lr=1e-3), params, [])
    gen = torch.Generator().manual_seed(ctx.rank)
    for step in range(args.warmup + args.steps):
        for ddp, optimizer, _, times in runs.values():
            inputs, targets = workload.batch(gen)
            start = time.perf_counter()
            workload.loss(ddp(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
    return {
        mode: {
            "median_step_s": statistics.median(slowest(times)),
            "trainable_params": sum(p.numel() for p in params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in params),
        }
        for mode, (_, _, params, times) in runs.items()
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="collectives_topology_worker.py")
    parser.add_argument("what", choices=["allreduce", "train"])
    parser.add_argument("--algorithms", default="ring,hierarchical,native")
    parser.add_argument("--size", type=int, default=25_000_000, help="bytes (fp32)")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--iface", default=None, help="the inter-node interface to count")
    parser.add_argument("--allreduce", default="native", help="the engine's all-reduce")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    ctx = lockstep.init()
    try:
        result = run_allreduce(ctx, args) if args.what == "allreduce" else run_train(ctx, args)
    finally:
        lockstep.shutdown()
    if ctx.is_main:
        result["world_size"], result["local_world_size"] = ctx.world_size, ctx.local_world_size
        Path(args.out, f"{args.label}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
