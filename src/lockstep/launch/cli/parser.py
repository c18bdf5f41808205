"""`lockstep run`: the subcommand's flags, turned into a `RunConfig`.

    lockstep run --nproc-per-node 2 train.py                     # one node
    lockstep run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --nproc-per-node 8 --max-restarts 3 train.py --lr 0.1     # node 0 of two
    srun lockstep run train.py                                    # Slurm fills in the rest

Under Slurm (SLURM_JOB_ID and SLURM_NNODES set) the node count, node rank, master
address and port default to the job's; a flag given explicitly wins.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.env import DEFAULT_MASTER_ADDR, read_slurm_nodes
from lockstep.launch.cli.config import (
    DEFAULT_EXIT_GRACE_S,
    DEFAULT_RDZV_TIMEOUT_S,
    DEFAULT_REJOIN_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    RunConfig,
    add_nproc_flag,
    parse_nproc,
)

DEFAULTS: dict[str, str | int] = {
    "nnodes": 1,
    "node_rank": 0,
    "master_addr": DEFAULT_MASTER_ADDR,
    "master_port": 0,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="launch a training script on this node's workers",
        description="Launch SCRIPT (or -m MODULE) once per worker, with RANK, WORLD_SIZE, ... set.",
    )
    _placement_flags(run)
    add_nproc_flag(run)
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole group (every node) up to this many times after a failure",
    )
    run.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="end the run when no worker progressed for this many seconds while some wait "
        "in a collective, naming the stuck rank with its stack (0: off)",
    )
    run.add_argument(
        "--exit-grace",
        type=float,
        default=DEFAULT_EXIT_GRACE_S,
        help="seconds a worker may take to exit after its script ended; then it is named "
        "with its stack and ended, and the run's result is the scripts' (default 30)",
    )
    run.add_argument(
        "--live-recovery",
        action="store_true",
        help="replace a worker killed by a signal with a new process of the same rank while "
        "the others keep running (lockstep.DistributedDataParallel, gloo; docs/multinode.md, "
        "'Live recovery'); anything else restarts the whole group",
    )
    run.add_argument(
        "--rejoin-timeout",
        type=float,
        default=DEFAULT_REJOIN_TIMEOUT_S,
        help="with --live-recovery on several nodes: seconds the others keep their workers "
        "waiting for a lost node to be started again (same arguments) before the whole-group "
        "restart (default 120)",
    )
    run.add_argument(
        "--spares",
        type=int,
        default=0,
        help="with --live-recovery: keep this many standby workers per node that have "
        "imported torch and lockstep and take a lost rank (docs/multinode.md)",
    )
    run.add_argument(
        "--no-fork-server",
        action="store_true",
        help="with --live-recovery: no fork server (a process per node that has imported "
        "torch and lockstep and forks a replacement in milliseconds); a new process, which "
        "imports torch first, takes a lost rank when no spare is idle",
    )
    run.add_argument(
        "--replace-stuck",
        action="store_true",
        help="with --live-recovery: a worker the stall watch declares stuck gets SIGKILL "
        "and is replaced live, instead of ending the round",
    )
    run.add_argument(
        "--engine",
        choices=["torch", "lockstep"],
        default=None,
        help="lockstep: torch's DistributedDataParallel builds lockstep's engine in every "
        "worker (LOCKSTEP_ENGINE), for Accelerate, Trainer and Lightning scripts unchanged",
    )
    run.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="every worker writes DIR/trace_rank<R>.json (LOCKSTEP_TRACE); at the end this "
        "node merges them, draws DIR/timeline.png and prints the straggler line",
    )
    run.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the target as a module, like `python -m`",
    )
    run.add_argument("target", help="the script (or module with -m) to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=main)


def _placement_flags(run: argparse.ArgumentParser) -> None:
    """Where this node sits in the job and how it finds the others."""
    run.add_argument("--nnodes", type=int, help="nodes in the job (default 1, or Slurm's)")
    run.add_argument("--node-rank", type=int, help="this node's index in [0, nnodes)")
    run.add_argument("--master-addr", help="address of node 0, which hosts the rendezvous")
    run.add_argument("--master-port", type=int, help="its port; 0 or omitted: a free one")
    run.add_argument(
        "--rdzv-timeout",
        type=int,
        default=DEFAULT_RDZV_TIMEOUT_S,
        help="seconds nodes wait for each other (at start and after each restart)",
    )
    run.add_argument(
        "--local-addr",
        help="this node's address as the others reach it (default: the one routed to the master)",
    )
    run.add_argument(
        "--secret-file",
        help="file holding the job's secret, the same on every node (default: "
        "LOCKSTEP_JOB_SECRET; one node alone generates one)",
    )


def _placement(ns: argparse.Namespace) -> dict[str, str | int]:
    """nnodes, node_rank, master_addr, master_port: flags, else Slurm's, else defaults."""
    slurm = read_slurm_nodes() or {}
    return {
        key: getattr(ns, key) if getattr(ns, key) is not None else slurm.get(key, default)
        for key, default in DEFAULTS.items()
    }


def run_config(ns: argparse.Namespace) -> RunConfig:
    """Validate the flags; raises ValueError with a message naming the flag."""
    if not ns.module and not Path(ns.target).is_file():
        raise ValueError(
            f"script {ns.target!r} not found; expected a path to a Python file "
            "(or `-m package.module`)"
        )
    target = ["-m", ns.target, *ns.args] if ns.module else [ns.target, *ns.args]
    place = _placement(ns)
    return RunConfig(
        target=target,
        nproc_per_node=parse_nproc(ns.nproc_per_node),
        nnodes=int(place["nnodes"]),
        node_rank=int(place["node_rank"]),
        master_addr=str(place["master_addr"]),
        master_port=int(place["master_port"]),
        max_restarts=ns.max_restarts,
        rdzv_timeout_s=ns.rdzv_timeout,
        local_addr=ns.local_addr,
        stall_timeout_s=ns.stall_timeout,
        trace_dir=ns.trace,
        secret_file=ns.secret_file,
        exit_grace_s=ns.exit_grace,
        extra_env=_extra_env(ns),
        live_recovery=ns.live_recovery,
        spares=ns.spares,
        fork_server=not ns.no_fork_server,
        replace_stuck=ns.replace_stuck,
        rejoin_timeout_s=ns.rejoin_timeout,
    )


def _extra_env(ns: argparse.Namespace) -> dict[str, str]:
    env = {"LOCKSTEP_ENGINE": ns.engine} if ns.engine else {}
    if ns.live_recovery:
        env["LOCKSTEP_LIVE"] = "1"  # `lockstep.live.group.LIVE_VARIABLE`
    return env


def main(ns: argparse.Namespace) -> int:
    from lockstep.launch.supervise.runner import run

    return run(run_config(ns))
