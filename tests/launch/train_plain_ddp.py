"""A plain DDP script, with no Monitor and no trace code: what LOCKSTEP_TRACE must see into.

    LOCKSTEP_TRACE=/tmp/t lockstep run --nproc-per-node 2 train_plain_ddp.py --out /tmp/o
    LOCKSTEP_TRACE=/tmp/t torchrun --nproc-per-node 2 train_plain_ddp.py --out /tmp/o
    lockstep run --trace /tmp/t --nproc-per-node 2 train_plain_ddp.py --out /tmp/o

After every step each rank appends the engine's own figures (`ddp.stats`) to
OUT/stats_rank<R>.jsonl: the oracle the tests compare the trace with.
`--slow-rank R --slow-ms M` makes rank R sleep M ms before each forward (a slow
data loader); `--kill-rank R --kill-step S` makes rank R wait until its trace
file holds step S-1, then SIGKILL itself before step S.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import lockstep


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    return parser.parse_args()


def stats_record(stats) -> dict:
    buckets = [[b.index, b.nbytes, b.ready, b.launched, b.done] for b in stats.buckets]
    return {"step": stats.step, "forward": stats.forward_seconds, "buckets": buckets}


def wait_for_trace_step(step: int, rank: int, deadline_s: float = 30.0) -> None:
    """Block until this rank's trace file (written in the background) holds `step`."""
    path = Path(os.environ["LOCKSTEP_TRACE"]) / f"trace_rank{rank}.json"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if path.exists():
            events = json.loads(path.read_text())["traceEvents"]
            if any(e.get("args", {}).get("step") == step for e in events):
                return
        time.sleep(0.05)
    raise RuntimeError(f"rank {rank}: {path} did not reach step {step} in {deadline_s} s")


def main() -> None:
    args = parse_args()
    ctx = lockstep.init()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)]
    model = nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, 1))
    ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"stats_rank{ctx.rank}.jsonl", "w") as oracle:
        for step in range(1, args.steps + 1):
            if ctx.rank == args.kill_rank and step == args.kill_step:
                wait_for_trace_step(step - 1, ctx.rank)
                os.kill(os.getpid(), signal.SIGKILL)
            if ctx.rank == args.slow_rank:
                time.sleep(args.slow_ms / 1e3)
            x = torch.randn(6, 8, generator=gen)
            ddp(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            oracle.write(json.dumps(stats_record(ddp.stats)) + "\n")
            oracle.flush()
    lockstep.shutdown()


if __name__ == "__main__":
    main()
