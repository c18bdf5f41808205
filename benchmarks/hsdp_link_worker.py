"""Stage 3, flat or hybrid (HSDP), under `lockstep run`; records the node's link bytes per step.

    lockstep run --nproc-per-node 2 --nnodes 2 ... benchmarks/hsdp_link_worker.py --out DIR --hybrid

A stack of wrapped blocks (every parameter inside a unit, so each unit is
gathered exactly twice a step). Before each step every rank meets at a barrier,
local rank 0 reads its namespace's veth counter
(/sys/class/net/<veth>/statistics/tx_bytes, the namespace's own sysfs under
`ip netns exec`), and a second barrier lets the step start; after it, one more
barrier and the counter again. Rank 0 and the first rank of node 1 write per-step bytes,
step seconds, the step stats and the gradient bytes to OUT/node<k>.json
(`--both`: flat, then hybrid, in one job, under "flat" and "hsdp").
`benchmarks/hsdp_link.py` runs it over a link slowed with `tc`, and
`tests/launch/test_hsdp_nodes.py` over an unshaped one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lockstep


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _tx_bytes() -> int:
    """Bytes sent so far on this namespace's one non-loopback interface."""
    links = [p for p in Path("/sys/class/net").iterdir() if p.name != "lo"]
    return sum(int((p / "statistics" / "tx_bytes").read_text()) for p in links)


def _retransmitted() -> int:
    """TCP segments this namespace has sent again (/proc/net/snmp, RetransSegs)."""
    rows = [line.split() for line in Path("/proc/self/net/snmp").read_text().splitlines()]
    tcp = [row for row in rows if row[0] == "Tcp:"]
    return int(tcp[1][tcp[0].index("RetransSegs")])


def train(args: argparse.Namespace, ctx: lockstep.DistContext, hybrid: bool) -> dict:
    """A few steps of stage 3, flat or hybrid; per step: bytes node sent, seconds, resends."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    model = lockstep.ShardedDataParallel(net, stage=3, wrap=[Block], hybrid=hybrid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sent, seconds, resent = [], [], []
    for step in range(args.steps):
        x = torch.randn(
            4, args.width, generator=torch.Generator().manual_seed(step * 100 + ctx.rank)
        )
        dist.barrier()
        before, start, again = _tx_bytes(), time.perf_counter(), _retransmitted()
        dist.barrier()  # no rank starts the step before the counter is read
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        sent.append(_tx_bytes() - before)
        seconds.append(time.perf_counter() - start)
        resent.append(_retransmitted() - again)
    return {
        "sent": sent,
        "seconds": seconds,
        "retransmitted_segments": resent,
        "grad_bytes": grad_bytes,
        "wire_levels": dict(model.stats.wire_levels),
        "shard_numel": sum(f.shard.numel() for f in model.flats),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--both", action="store_true", help="flat, then hybrid, in one job")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    ctx = lockstep.init()
    torch.set_num_threads(1)
    if args.both:
        record = {"flat": train(args, ctx, False), "hsdp": train(args, ctx, True)}
    else:
        record = train(args, ctx, args.hybrid)
    if ctx.local_rank == 0:
        Path(args.out, f"node{ctx.node_rank}.json").write_text(json.dumps(record))
    lockstep.shutdown()


if __name__ == "__main__":
    main()
