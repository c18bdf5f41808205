"""`lockstep bench allreduce`: validate the sweep, then launch its workers like training.

The flags are checked here, before any process starts (bad input: one line, exit
code 2); then lockstep's launcher starts `lockstep.bench.allreduce_worker` on
every worker, the same path `lockstep run` takes, so the numbers are those a
training job on this node would see.
"""

from __future__ import annotations

import argparse

from lockstep.bench.allreduce_worker import add_sweep_flags, sweep_options
from lockstep.launch.cli.config import add_nproc_flag

WORKER = "lockstep.bench.allreduce_worker"


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "allreduce",
        help="all-reduce time and bandwidth over a size sweep (nccl-tests layout)",
        description="Time all-reduce from --min-bytes to --max-bytes on this node's workers. "
        "busbw = algbw x 2(N-1)/N; GB/s = 1e9 bytes/s. --json FILE feeds "
        "`lockstep plan --bandwidth-from FILE`.",
    )
    add_nproc_flag(bench)
    add_sweep_flags(bench)
    bench.set_defaults(handler=main)


def worker_argv(ns: argparse.Namespace) -> list[str]:
    """The worker's command line: the validated sweep flags, passed on as given."""
    argv = ["--min-bytes", ns.min_bytes, "--max-bytes", ns.max_bytes, "--factor", str(ns.factor)]
    argv += ["--iters", str(ns.iters), "--warmup", str(ns.warmup), "--dtype", ns.dtype]
    if ns.backend:
        argv += ["--backend", ns.backend]
    if ns.json:
        argv += ["--json", ns.json]
    return argv


def main(ns: argparse.Namespace) -> int:
    from lockstep.launch import RunConfig, run
    from lockstep.launch.cli.config import parse_nproc

    sweep_options(ns)  # raises ValueError on bad flags before anything starts
    cfg = RunConfig(
        target=["-m", WORKER, *worker_argv(ns)], nproc_per_node=parse_nproc(ns.nproc_per_node)
    )
    return run(cfg)
