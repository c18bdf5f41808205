"""Start this node's workers through torch.distributed.elastic and report how they ended.

The elastic agent does the real work: c10d rendezvous, spawning one process
per worker with RANK/WORLD_SIZE/... set, watching them, restarting the group.
This module builds its `LaunchConfig` from a `RunConfig`, points every worker
at `lockstep.launch.bootstrap` (so failures are recorded with their traceback),
and turns the outcome into an exit code and a short summary.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from lockstep.launch.config import RunConfig
from lockstep.launch.report import summarize

log = logging.getLogger("lockstep.run")


def _worker_threads(cfg: RunConfig) -> str:
    """Share the node's cores between its workers, as torchrun does with OMP_NUM_THREADS."""
    return str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))


def _launch_config(cfg: RunConfig) -> LaunchConfig:
    single = cfg.nnodes == 1
    return LaunchConfig(
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=cfg.run_id if not single else f"{cfg.run_id}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{cfg.master_addr}:{cfg.master_port}",
        rdzv_configs={"timeout": cfg.rdzv_timeout_s, "is_host": cfg.node_rank == 0},
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=cfg.local_addr or (cfg.master_addr if single else None),
    )


def run(cfg: RunConfig) -> int:
    """Launch the workers of one node and wait for them.

    Returns:
        0 when every worker succeeded, 1 when one failed (a summary is on stderr).
    """
    os.environ.setdefault("OMP_NUM_THREADS", _worker_threads(cfg))
    os.environ.update(cfg.extra_env)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    entry_args = ["-u", "-m", "lockstep.launch.bootstrap", *cfg.target]
    try:
        launch_agent(_launch_config(cfg), sys.executable, entry_args)
    except ChildFailedError as error:
        print(summarize(error, cfg.node_rank), file=sys.stderr, flush=True)
        return 1
    return 0
