"""`RunConfig`: the validated, frozen description of what `lockstep run` launches."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import torch

from lockstep.env import DEFAULT_MASTER_ADDR

MAX_AUTO_CPU_PROCS = 4


DEFAULT_RDZV_TIMEOUT_S = 120
DEFAULT_STALL_TIMEOUT_S = 60.0
DEFAULT_EXIT_GRACE_S = 30.0
DEFAULT_REJOIN_TIMEOUT_S = 120.0


def add_nproc_flag(parser: argparse.ArgumentParser) -> None:
    """The one definition of --nproc-per-node, shared by `run` and the benches."""
    parser.add_argument(
        "--nproc-per-node",
        default="auto",
        help="workers on this node: an integer, or 'auto' (one per GPU, else one "
        "per CPU core up to 4)",
    )


@dataclass(frozen=True)
class RunConfig:
    """One node's share of a job.

    Attributes:
        target: what each worker runs: ["script.py", *args] or ["-m", "pkg.mod", *args].
        nproc_per_node: workers on this node.
        nnodes: nodes in the job.
        node_rank: this node's index.
        master_addr: address of the rendezvous host (node 0).
        master_port: its port; 0 picks a free one (single node only).
        max_restarts: whole-group restarts allowed after a worker failure.
        rdzv_timeout_s: how long nodes wait for each other at a rendezvous (and, on nodes
            other than 0, for the master's port to answer before the first one).
        run_id: the job's name at the rendezvous; nodes of one job share it.
        local_addr: this node's address as the other nodes reach it; None asks the
            routing table which local address leads to the master.
        extra_env: variables added to the workers' environment.
        shutdown_timeout_s: after SIGTERM, seconds a worker gets before SIGKILL.
        stall_timeout_s: end the run when no worker progressed for this long while
            some wait in a collective (`lockstep.launch.watches.stall`); 0 turns the watch off.
        trace_dir: with --trace, where every worker writes its trace (LOCKSTEP_TRACE).
        exit_grace_s: seconds a worker may take to exit after its script ended well,
            before it is named with its stack and ended (`lockstep.launch.watches.exits`).
        live_recovery: replace a lost worker live, keeping the others (`launch/recovery/`).
        spares: standby workers per node that take a lost rank (`launch/recovery/spares.py`).
        fork_server: with live_recovery, a process per node that imported ahead forks the
            replacement when no spare is idle (`launch/recovery/forks.py`).
        replace_stuck: with live_recovery, a worker the stall watch declares stuck is
            killed and replaced live instead of ending the round (`launch/recovery/stuck.py`).
        rejoin_timeout_s: with live recovery on several nodes, how long the others wait
            for a lost node to be started again and rejoin (`launch/recovery/nodes.py`).
        secret_file: a file holding the job's secret (else LOCKSTEP_JOB_SECRET; one node
            alone generates one): `lockstep.launch.rendezvous.secret`.
    """

    target: list[str]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    max_restarts: int = 0
    rdzv_timeout_s: int = DEFAULT_RDZV_TIMEOUT_S
    run_id: str = "lockstep"
    local_addr: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    shutdown_timeout_s: int = 10
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    trace_dir: str | None = None
    live_recovery: bool = False
    spares: int = 0
    fork_server: bool = True
    replace_stuck: bool = False
    rejoin_timeout_s: float = DEFAULT_REJOIN_TIMEOUT_S
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S
    secret_file: str | None = None

    def __post_init__(self) -> None:
        if not self.target or self.target == ["-m"]:
            raise ValueError("expected a script path or `-m module` to run; found nothing")
        if self.nproc_per_node < 1:
            raise ValueError(
                f"--nproc-per-node must be a positive integer or 'auto'; found "
                f"{self.nproc_per_node}"
            )
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1; found {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}; "
                f"found {self.node_rank}"
            )
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be in [0, 65535]; found {self.master_port}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError(
                "--master-port is required with --nnodes > 1 (every node must use the same "
                "port); pick one that is open on the master node, for example 29500"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be at least 0; found {self.max_restarts}")
        if self.rdzv_timeout_s < 1:
            raise ValueError(
                f"--rdzv-timeout must be at least 1 second; found {self.rdzv_timeout_s}"
            )
        if not self.master_addr:
            raise ValueError("--master-addr must name the master node; found an empty string")
        self._check_stall_timeout()
        self._check_spares()

    def _check_stall_timeout(self) -> None:
        if not 0 < self.rejoin_timeout_s < 1e6:
            raise ValueError(
                f"--rejoin-timeout must be a positive number of seconds (how long the other "
                f"nodes wait for a lost node to come back); found {self.rejoin_timeout_s}"
            )
        if self.replace_stuck and not (self.live_recovery and self.stall_timeout_s):
            raise ValueError(
                "--replace-stuck replaces a stuck worker live: it needs --live-recovery and the "
                f"stall watch (--stall-timeout > 0); found --live-recovery "
                f"{'on' if self.live_recovery else 'off'}, --stall-timeout {self.stall_timeout_s:g}"
            )
        if self.stall_timeout_s < 0:
            raise ValueError(
                f"--stall-timeout must be >= 0 seconds (0: off); found {self.stall_timeout_s}"
            )
        if self.exit_grace_s <= 0:
            raise ValueError(f"--exit-grace must be > 0 seconds; found {self.exit_grace_s}")

    def _check_spares(self) -> None:
        if self.spares < 0:
            raise ValueError(f"--spares must be at least 0; found {self.spares}")
        if self.spares and not self.live_recovery:
            raise ValueError(
                f"--spares {self.spares} needs --live-recovery (a spare takes the rank of a "
                "worker replaced live); add the flag or drop --spares"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def auto_nproc_per_node() -> int:
    """One worker per visible GPU; without GPUs one per CPU core, at most 4."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(MAX_AUTO_CPU_PROCS, os.cpu_count() or 1))


def parse_nproc(value: str) -> int:
    """Parse --nproc-per-node: 'auto' or a positive integer."""
    if value == "auto":
        return auto_nproc_per_node()
    try:
        count = int(value)
    except ValueError:
        raise ValueError(
            f"--nproc-per-node must be a positive integer or 'auto'; found {value!r}"
        ) from None
    if count < 1:
        raise ValueError(f"--nproc-per-node must be a positive integer or 'auto'; found {count}")
    return count
