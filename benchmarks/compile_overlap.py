"""How much all-reduce overlap each way of combining torch.compile with the wrapper keeps.

    python benchmarks/compile_overlap.py                     # aot_eager, world size 2
    python benchmarks/compile_overlap.py --backend inductor --steps 12

Four ways, each with lockstep's class and with torch's, on the same model (a
stack of user-defined blocks, small buckets so that there are several):
`eager` (no compile), `inner` = DDP(torch.compile(model)), `outer` =
torch.compile(DDP(model)), `blocks` = compile each block, then wrap. After one
compiling step, the eight configurations train in turn (A/B, then B/A) on two
gloo ranks. Reported per way: median step time of each class and their ratio;
from lockstep's own StepStats, the overlap (share of all-reduce time hidden
behind backward), the time backward waited for communication, and where in
backward the first bucket was launched (0 = at its start, 1 = at its end); and
Dynamo's count of graph breaks and graphs per class.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.runtime.step_stats import StepStats
from lockstep.testing import run_ranks

WAYS = ("eager", "inner", "outer", "blocks")
CLASSES = ("lockstep", "torch")
BUCKET_MB = 1.0  # about one block (512 x 512 fp32) per bucket; torch needs >= its 1 MiB first


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(way: str, cls: str, args: argparse.Namespace) -> tuple[nn.Module, Callable]:
    """The wrapper and the callable a step runs, for one way and one class."""
    torch.manual_seed(0)
    model = Net(args.width, args.depth)
    compile_ = lambda m: torch.compile(m, backend=args.backend)  # noqa: E731
    if way == "inner":
        model = compile_(model)
    elif way == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = compile_(block)
    if cls == "lockstep":
        ddp = lockstep.DistributedDataParallel(
            model, bucket_cap_mb=BUCKET_MB, first_bucket_cap_mb=BUCKET_MB
        )
    else:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    return ddp, compile_(ddp) if way == "outer" else ddp


class Config:
    """One way with one class: its model, optimizer, timings and lockstep's step figures."""

    def __init__(self, way: str, cls: str, args: argparse.Namespace, batch: torch.Tensor) -> None:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        self.ddp, self.run = build(way, cls, args)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        self.batch = batch
        start = time.perf_counter()
        self.step()  # compiles
        self.compile_seconds = time.perf_counter() - start
        self.graph_breaks = sum(counters["graph_break"].values())
        self.graphs = counters["stats"]["unique_graphs"]
        self.times: list[float] = []
        self.stats: list[StepStats] = []

    def step(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad()
        self.run(self.batch).pow(2).mean().backward()
        self.opt.step()
        return time.perf_counter() - start

    def phase(self, steps: int) -> None:
        dist.barrier()
        for _ in range(steps):
            self.times.append(self.step())
            if isinstance(self.ddp, lockstep.DistributedDataParallel):
                self.stats.append(self.ddp.stats)


def rank_main(ctx: lockstep.DistContext, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(ctx.rank))
    configs = {(way, cls): Config(way, cls, args, batch) for way in WAYS for cls in CLASSES}
    order = list(configs)
    for rep in range(args.reps):
        for key in order if rep % 2 == 0 else order[::-1]:
            configs[key].phase(args.steps)
    return {key: summarize(c) for key, c in configs.items()}


def first_launch(stats: StepStats) -> float:
    """Where in backward the first bucket was launched: 0 at its start, 1 at its end."""
    launched = min(b.launched for b in stats.buckets) - stats.forward_seconds
    return launched / stats.backward_seconds if stats.backward_seconds > 0 else float("nan")


def summarize(config: Config) -> dict:
    row = {
        "ms": 1e3 * statistics.median(config.times),
        "compile_s": config.compile_seconds,
        "graph_breaks": config.graph_breaks,
        "graphs": config.graphs,
    }
    if config.stats:
        row["overlap"] = statistics.median(s.overlap for s in config.stats)
        row["exposed_ms"] = 1e3 * statistics.median(s.exposed_seconds for s in config.stats)
        row["first_launch"] = statistics.median(first_launch(s) for s in config.stats)
        row["buckets"] = len(config.stats[-1].buckets)
    return row


def table(rows: dict) -> str:
    lines = [
        "| way | ms/step lockstep / torch | ratio | lockstep overlap | lockstep wait after"
        " backward (ms) | first bucket launched at (share of backward) | graph breaks"
        " lockstep / torch | graphs lockstep / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        ours, theirs = rows[(way, "lockstep")], rows[(way, "torch")]
        lines.append(
            f"| {way} | {ours['ms']:.1f} / {theirs['ms']:.1f} | {ours['ms'] / theirs['ms']:.2f} "
            f"| {ours['overlap']:.0%} | {ours['exposed_ms']:.2f} | {ours['first_launch']:.2f} "
            f"| {ours['graph_breaks']} / {theirs['graph_breaks']} "
            f"| {ours['graphs']} / {theirs['graphs']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps per phase")
    args = parser.parse_args()
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    results = run_ranks(rank_main, 2, args, deadline_s=3600, timeout_s=600, env=env)
    print(f"backend {args.backend}, world size 2, {args.depth} blocks of {args.width}")
    print(table(results[0]))


if __name__ == "__main__":
    main()
