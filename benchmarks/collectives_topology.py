"""The topology experiment: 2 nodes x 2 processes, a slow link between nodes, loopback inside.

    sudo .venv/bin/python benchmarks/collectives_topology.py --rate 1gbit --out /tmp/topology

Two network namespaces joined by a veth pair (lockstep.testing.netns.two_hosts) play the
two nodes; `tc` limits each direction of the link to --rate. On them `lockstep
run --nnodes 2 --nproc-per-node 2` starts benchmarks/collectives_topology_worker.py:
1. all-reduce of a 25 MB fp32 tensor with the flat ring, the hierarchical
   all-reduce and gloo's native one: median time, and the bytes each node's veth
   sent per call (kernel counters);
2. training steps of the small GPT (benchmarks/workloads.py), full fine-tune and
   LoRA alternating in one job, across the link (with the engine's native and
   hierarchical all-reduce), then on one node (4 processes, loopback).
Needs root and iproute2. Prints markdown tables; --out keeps the JSON of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from lockstep.testing.netns import Host, two_hosts, unavailable_reason

WORKER = str(Path(__file__).with_name("collectives_topology_worker.py"))
PORT = 29561  # inside our own namespaces: nothing else listens there
TIMEOUT_S = 900
# Both nodes need the same job secret; a scheduler would export it, this driver does.
os.environ.setdefault("LOCKSTEP_JOB_SECRET", secrets.token_hex(32))


def _launch(argv: list[str], log: Path, host: Host | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lockstep.cli", "run", *argv]
    with open(log, "w") as sink:
        kwargs = {"stdout": sink, "stderr": subprocess.STDOUT}
        return host.popen(cmd, **kwargs) if host else subprocess.Popen(cmd, **kwargs)


def _wait(procs: list[subprocess.Popen], logs: list[Path], result: Path) -> dict:
    """Wait for the launchers; return rank 0's JSON, failing (with the logs) if there is none.

    A run that wrote its result and then failed on the way out is kept, with a warning.
    """
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    if not result.exists():
        raise SystemExit(f"a run failed:\n{text}")
    if any(proc.returncode for proc in procs):
        print(f"warning: {result.name} was written, then the run failed:\n{text}", file=sys.stderr)
    return json.loads(result.read_text())


def two_nodes(a: Host, b: Host, worker_args: list[str], out: Path, label: str) -> dict:
    """Run the worker on 2 nodes x 2 processes (a is node 0); return rank 0's JSON."""
    (out / f"{label}.json").unlink(missing_ok=True)
    procs, logs = [], []
    for node, host in enumerate((a, b)):
        argv = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", a.address]
        argv += ["--master-port", str(PORT), "--nproc-per-node", "2", WORKER]
        argv += [*worker_args, "--iface", host.interface, "--out", str(out), "--label", label]
        logs.append(out / f"{label}.node{node}.log")
        procs.append(_launch(argv, logs[-1], host))
    return _wait(procs, logs, out / f"{label}.json")


def one_node(worker_args: list[str], out: Path, label: str) -> dict:
    """Run the worker on this machine's loopback with 4 processes; return rank 0's JSON."""
    log = out / f"{label}.log"
    (out / f"{label}.json").unlink(missing_ok=True)
    argv = ["--nproc-per-node", "4", WORKER, *worker_args, "--out", str(out), "--label", label]
    return _wait([_launch(argv, log, None)], [log], out / f"{label}.json")


def allreduce_table(result: dict, size: int) -> str:
    ring = result["ring"]["median_s"]
    lines = [
        f"| algorithm ({size / 1e6:.0f} MB fp32) | median time | vs flat ring "
        "| veth bytes sent per call, node 0 / node 1 |",
        "|---|---:|---:|---:|",
    ]
    for name, row in result.items():
        if not isinstance(row, dict):
            continue
        tx = " / ".join(f"{b / 1e6:.1f} MB" for b in row["tx_bytes_per_call_by_node"])
        lines.append(
            f"| {name} | {row['median_s'] * 1e3:.0f} ms | {ring / row['median_s']:.2f}x | {tx} |"
        )
    return "\n".join(lines)


def train_table(runs: dict[str, dict]) -> str:
    lines = [
        "| where | full: median step | LoRA: median step | full / LoRA |",
        "|---|---:|---:|---:|",
    ]
    for where, row in runs.items():
        full, lora = row["full"]["median_step_s"], row["lora"]["median_step_s"]
        lines.append(f"| {where} | {full * 1e3:.0f} ms | {lora * 1e3:.0f} ms | {full / lora:.2f} |")
    some = next(iter(runs.values()))
    lines.append("")
    for mode in ("full", "lora"):
        lines.append(
            f"{mode}: {some[mode]['trainable_params']:,} trainable parameters, "
            f"{some[mode]['gradient_bytes'] / 1e6:.2f} MB of gradients per step"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="inter-node link rate (tc syntax)")
    parser.add_argument("--size", type=int, default=25_000_000, help="all-reduce bytes")
    parser.add_argument("--iters", type=int, default=6, help="calls per block (2 blocks)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each model")
    parser.add_argument("--out", default="/tmp/lockstep-topology")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot run the topology experiment: {reason}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    allreduce_args = ["allreduce", "--size", str(args.size), "--iters", str(args.iters)]
    train = ["train", "--steps", str(args.steps)]
    runs: dict[str, dict] = {}
    link = f"2 nodes x 2, {args.rate} link"
    with two_hosts(rate=args.rate) as (a, b):
        result = two_nodes(a, b, allreduce_args, out, "allreduce-2x2")
        runs[link] = two_nodes(a, b, train, out, "train-2x2")
        hierarchical = [*train, "--allreduce", "hierarchical"]
        runs[f"{link}, engine allreduce=hierarchical"] = two_nodes(
            a, b, hierarchical, out, "train-2x2-hierarchical"
        )
    runs["1 node x 4"] = one_node(train, out, "train-1x4")
    print(f"## All-reduce across a {args.rate} link, 2 nodes x 2 processes\n")
    print(allreduce_table(result, args.size))
    print("\n## Small GPT fine-tune step, full vs LoRA\n")
    print(train_table(runs))
    (out / "summary.json").write_text(json.dumps({"allreduce": result, "train": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
