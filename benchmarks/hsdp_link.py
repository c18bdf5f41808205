"""HSDP against flat stage 3 over a slow link between two nodes (network namespaces, `tc`).

    sudo PYTHONPATH=src python benchmarks/hsdp_link.py                 # 200 Mbit/s each way
    sudo PYTHONPATH=src python benchmarks/hsdp_link.py --rate 1gbit --delay 1ms --reps 3

Two namespaces joined by a veth pair stand for two nodes; each direction of the
pair is limited to `--rate` (tbf), with `--delay` one-way if given (netem, which
some kernels lack; `testing/netns.shape`).
Each node runs `lockstep run` with two workers (`hsdp_link_worker.py`: 8 wrapped
blocks of width `--width`, stage 3, SGD), once flat and once with hybrid=True,
alternating for `--reps` rounds. Reported: median step seconds (rank 0, steps
after the first), the bytes node 0 sent over the link per step (its veth
counter, which counts resent TCP segments too) against `lockstep plan`'s
per-link figure (`plan/hybrid.py`), and the TCP segments node 0 resent per step.
Needs root (namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lockstep.plan.hybrid import link_bytes
from lockstep.testing.netns import Host, two_hosts

WORKER = str(Path(__file__).with_name("hsdp_link_worker.py"))
PORT = 29561  # inside our own namespaces


def _node(a: Host, host: Host, rank: int, out: Path, worker: list[str]) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "lockstep.cli",
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        a.address,
        "--master-port",
        str(PORT),
        "--nproc-per-node",
        "2",
        WORKER,
        "--out",
        str(out),
        *worker,
    ]
    env = {
        **os.environ,
        "LOCKSTEP_JOB_SECRET": os.environ.get("LOCKSTEP_JOB_SECRET", "hsdp-link-benchmark-secret"),
    }
    log = open(out / f"launch{rank}.log", "w")  # noqa: SIM115 (closed with the process)
    return host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_once(args: argparse.Namespace, hybrid: bool, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    worker = ["--steps", str(args.steps), "--width", str(args.width)]
    worker += ["--hybrid"] if hybrid else []
    with two_hosts(rate=args.rate, delay=args.delay) as (a, b):
        procs = [_node(a, host, rank, out, worker) for rank, host in enumerate((a, b))]
        codes = [proc.wait(timeout=args.timeout) for proc in procs]
    if codes != [0, 0]:
        logs = "\n".join((out / f"launch{r}.log").read_text() for r in range(2))
        raise SystemExit(f"a node failed ({codes}):\n{logs}")
    return json.loads((out / "node0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--delay", default=None)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"flat stage 3": [], "HSDP stage 3": []}
    sent: dict[str, list[int]] = {key: [] for key in seconds}
    resent: dict[str, list[int]] = {key: [] for key in seconds}
    grad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = [False, True] if rep % 2 == 0 else [True, False]
            for hybrid in order:
                key = "HSDP stage 3" if hybrid else "flat stage 3"
                got = run_once(args, hybrid, Path(tmp) / f"{rep}-{int(hybrid)}")
                seconds[key] += got["seconds"][1:]
                sent[key] += got["sent"][1:]
                resent[key] += got["retransmitted_segments"][1:]
                grad = got["grad_bytes"]
    theory = {row.label: row.across_per_node for row in link_bytes(2, 2, grad, grad, grad)}
    plan_of = {"flat stage 3": "ZeRO-3", "HSDP stage 3": "HSDP-3"}
    flat = statistics.median(seconds["flat stage 3"])
    link = args.rate + (f" + {args.delay}" if args.delay else "")
    print(f"2 nodes x 2 workers, link {link} each way, G = {grad / 1e6:.2f} MB")
    print(
        "| engine | MB node 0 sent across / step | plan | measured / plan | "
        "TCP segments resent / step | s / step | vs flat |"
    )
    print("|---|---|---|---|---|---|---|")
    for key in seconds:
        mb, med = statistics.median(sent[key]), statistics.median(seconds[key])
        want = theory[plan_of[key]]
        print(
            f"| {key} | {mb / 1e6:.2f} | {want / 1e6:.2f} | {mb / want:.3f} | "
            f"{statistics.median(resent[key]):.0f} | {med:.2f} | {med / flat:.2f} |"
        )


if __name__ == "__main__":
    main()
