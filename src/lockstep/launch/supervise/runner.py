"""Start this node's workers through torch.distributed.elastic and report how they ended.

`run(cfg)` is everything `lockstep run` does on one node: pre-flight checks
(`preflight`), the job's secret (`secret`), choice of address and interface (logged,
and given to gloo and NCCL unless the user chose), node 0's store on that address
alone (`store`), lockstep's sealed rendezvous (`rendezvous`), the elastic agent
with whole-group failover (`agent`), and one short summary when it ends badly.
Workers start as `python -m lockstep.launch.supervise.bootstrap`, which records their
tracebacks and ties their lives to this launcher's; what the run writes on the
side lives in one scratch folder (`scratch`), removed however the run ends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)

from lockstep.env import read_socket_ifnames
from lockstep.errors import LockstepError
from lockstep.launch.cli.config import RunConfig
from lockstep.launch.diagnostics import tracing
from lockstep.launch.diagnostics.preflight import check_master, find_route
from lockstep.launch.diagnostics.report import summarize
from lockstep.launch.recovery import LiveRecovery
from lockstep.launch.recovery.stuck import StuckReplacer
from lockstep.launch.rendezvous import store
from lockstep.launch.rendezvous.claims import NodeInfo, NodeRankRendezvousError
from lockstep.launch.rendezvous.foreign import MISMATCH_S, SecretMismatchError
from lockstep.launch.rendezvous.netif import Route
from lockstep.launch.rendezvous.rounds import LockstepRendezvous
from lockstep.launch.rendezvous.secret import Signer, load_secret
from lockstep.launch.rendezvous.store import BoundedStore
from lockstep.launch.supervise import group, scratch
from lockstep.launch.supervise.agent import LockstepAgent
from lockstep.launch.watches.exits import DIR_VARIABLE as EXIT_DIR_VARIABLE
from lockstep.launch.watches.exits import ExitWatch
from lockstep.launch.watches.stall import StallWatch
from lockstep.launch.watches.watchdog import Watchdog
from lockstep.runtime import progress

log = logging.getLogger("lockstep.run")
GRACE_S = 3.0  # how long a node waits for the others' reports after a failure
ABORT_LINGER_S = 1.5  # node 0 after a duplicated --node-rank: the others poll every 0.1 s
MISMATCH_LINGER_S = MISMATCH_S + 1.0  # node 0 after a foreign secret: node 1 may see it later
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Prepared(NamedTuple):
    """What the checks before the rendezvous found: who this node is, the master, the seal."""

    me: NodeInfo
    master_ip: str
    signer: Signer


def _setup_logging(node_rank: int) -> None:
    # The elastic agent's own loggers set their level per module; lockstep reports instead.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    for handler in log.handlers:
        formatter = logging.Formatter(
            f"lockstep run [node {node_rank} %(asctime)s]: %(message)s", datefmt="%H:%M:%S"
        )
        handler.setFormatter(formatter)


def _worker_threads(cfg: RunConfig) -> str:
    """Share the node's cores between its workers, as torchrun does with OMP_NUM_THREADS."""
    return str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))


def _set_worker_env(cfg: RunConfig, route: Route) -> str:
    """Variables the workers inherit; returns how the interface was chosen, for the log."""
    os.environ.setdefault("OMP_NUM_THREADS", _worker_threads(cfg))
    os.environ.update(cfg.extra_env)
    # Every worker's ranks are node_rank * nproc + local_rank: torch's agent needs no store.
    os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
    chosen = read_socket_ifnames()
    parts = [f"{name}={value} as set" for name, value in chosen.items()]
    unset = [name for name in IFNAME_VARIABLES if name not in chosen]
    # gloo listens on this interface alone (one node: loopback, so nothing is reachable).
    if route.interface is not None and unset:
        os.environ.update({name: route.interface for name in unset})
        parts.insert(0, f"{route.interface} ({', '.join(unset)})")
    elif unset:
        parts.append("unknown: set them")
    return "; ".join(parts)


def _silence_s(cfg: RunConfig) -> float:
    """How long a node may go unheard (heartbeat, store call) before it counts as lost."""
    return max(10.0, cfg.rdzv_timeout_s / 4)


def _agent(
    cfg: RunConfig,
    rendezvous: LockstepRendezvous,
    watchdog: Watchdog,
    directory: Path,
    stalls: StallWatch | None = None,
    exits: ExitWatch | None = None,
) -> LockstepAgent:
    spec = WorkerSpec(
        role="worker",
        local_world_size=cfg.nproc_per_node,
        entrypoint=sys.executable,
        args=(
            "-u",
            "-m",
            "lockstep.launch.supervise.bootstrap",
            "--parent",
            str(os.getpid()),
            *cfg.target,
        ),
        rdzv_handler=rendezvous,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.1,
        local_addr=rendezvous.me.addr,
    )
    return LockstepAgent(
        spec,
        DefaultLogsSpecs(log_dir=str(directory / "elastic")),
        start_method="spawn",
        exit_barrier_timeout=cfg.rdzv_timeout_s,
        shutdown_timeout=cfg.shutdown_timeout_s,
        grace_s=GRACE_S,
        silence_s=_silence_s(cfg),
        rdzv_timeout_s=cfg.rdzv_timeout_s,
        watchdog=watchdog,
        stalls=stalls,
        exits=exits,
        recovery=LiveRecovery.prepare(cfg, rendezvous, _silence_s(cfg), exits),
    )


def _describe_start(cfg: RunConfig, me: NodeInfo, route: Route, ifname: str) -> None:
    first = cfg.node_rank * cfg.nproc_per_node
    log.info(
        "node %d of %d on %s, address %s, interface %s; master %s:%d; ranks %d-%d of %d",
        cfg.node_rank,
        cfg.nnodes,
        me.host,
        route.local_addr,
        ifname,
        cfg.master_addr,
        cfg.master_port,
        first,
        first + cfg.nproc_per_node - 1,
        cfg.world_size,
    )


def run(cfg: RunConfig) -> int:
    """Launch the workers of one node and wait for them.

    Returns:
        0 when every worker succeeded; 1 when training failed or a check did not pass
        (a summary is on stderr); 128 + the signal number when the launcher was stopped.
    """
    _setup_logging(cfg.node_rank)
    try:
        prep = _prepare(cfg)
    except LockstepError as error:
        log.error("%s", error)
        return 1
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    with scratch.scratch_dir() as directory:
        code = _run_agent(cfg, prep, directory)
    if store.stuck():  # a store call that never returned would abort the interpreter's exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _open_store(cfg: RunConfig, prep: Prepared) -> tuple[object, BoundedStore]:
    """Node 0 hosts the launchers' store on the master address alone; every node dials it."""
    server, port = None, cfg.master_port
    if cfg.node_rank == 0:
        server, port = store.host(prep.master_ip, cfg.master_port, cfg.rdzv_timeout_s)
    return server, BoundedStore(prep.master_ip, port, _silence_s(cfg))


def _run_agent(cfg: RunConfig, prep: Prepared, directory: Path) -> int:
    on_exit = lambda: scratch.remove(directory)  # noqa: E731
    watchdog = Watchdog(f"{cfg.master_addr}:{cfg.master_port}", on_exit=on_exit)
    watchdog.pet("connecting to the rendezvous store", cfg.rdzv_timeout_s)
    try:
        server, client = _open_store(cfg, prep)
        rendezvous = LockstepRendezvous(
            client, prep.signer, prep.me, cfg.nnodes, cfg.run_id, cfg.rdzv_timeout_s
        )
        stalls = stall_watch(cfg, directory / "progress")
        exits = exit_watch(cfg, directory / "progress")  # stacks land beside progress
        agent = _agent(cfg, rendezvous, watchdog, directory, stalls, exits)
    except (RendezvousError, dist.DistError, OSError) as error:
        watchdog.stop()
        log.error(
            "cannot host the rendezvous store at %s:%d: %s", cfg.master_addr, cfg.master_port, error
        )
        return 1
    code, others_may_read = 1, False
    try:
        code, others_may_read = _supervise(cfg, agent)
    finally:
        agent.close()
        watchdog.pet("leaving the rendezvous")
        _leave(cfg, agent, others_may_read)
        watchdog.stop()
    tracing.report(cfg)
    del server  # node 0 hosted the store until every node left
    return code


def _prepare(cfg: RunConfig) -> Prepared:
    """Pre-flight, secret, address and interface (logged, exported to the workers)."""
    ip, route = find_route(cfg)
    signer = Signer(load_secret(cfg.nnodes, cfg.secret_file, cfg.node_rank))
    me = NodeInfo(cfg.node_rank, socket.gethostname(), route.local_addr)
    _describe_start(cfg, me, route, _set_worker_env(cfg, route))
    tracing.prepare(cfg)
    check_master(cfg, ip)
    return Prepared(me, ip, signer)


def _supervise(cfg: RunConfig, agent: LockstepAgent) -> tuple[int, bool]:
    """The exit code, and whether other nodes may still read this node's store."""
    try:
        result = agent.run()
    except SignalException as stop:
        agent.announce_stop(f"its launcher was stopped by {stop.sigval.name}")
        log.error("stopped by %s; this node's workers were stopped", stop.sigval.name)
        return 128 + int(stop.sigval), True
    except KeyboardInterrupt:
        agent.announce_stop("its launcher was interrupted (SIGINT)")
        return 128 + int(signal.SIGINT), True
    except (NodeRankRendezvousError, SecretMismatchError) as error:
        log.error("%s", _rendezvous_message(cfg, agent, error))
        if cfg.node_rank == 0:  # keep the store up while the other nodes read it and say so
            time.sleep(
                ABORT_LINGER_S if isinstance(error, NodeRankRendezvousError) else MISMATCH_LINGER_S
            )
        return 1, False
    except (LockstepError, RendezvousError) as error:
        log.error("%s", _rendezvous_message(cfg, agent, error))
        return 1, False
    if result is not None and result.is_failed():
        print(summarize(agent.reports, cfg.nnodes, cfg.node_rank), file=sys.stderr, flush=True)
        return 1, True
    if agent.restart_count:
        log.info("finished after %d restart(s)", agent.restart_count)
    return 0, True


def _rendezvous_message(cfg: RunConfig, agent: LockstepAgent, error: Exception) -> str:
    where = f"{cfg.master_addr}:{cfg.master_port}"
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"the {cfg.nnodes} nodes did not all join the rendezvous at {where} within "
            f"{cfg.rdzv_timeout_s} s{_last_cause(agent)}: {error}. Check that every node runs "
            f"`lockstep run` with --nnodes {cfg.nnodes} and the same --master-addr and "
            "--master-port, and read the other nodes' logs."
        )
    if isinstance(error, RendezvousClosedError):
        return (
            f"the rendezvous at {where} was closed by another node (it gave up or was "
            f"stopped){_last_cause(agent)}; read the other nodes' logs."
        )
    return str(error) or type(error).__name__


def _last_cause(agent: LockstepAgent) -> str:
    nodes = agent.rendezvous.nodes
    missing = [
        f"{node} ({nodes[node].host}, {nodes[node].addr})" if node in nodes else str(node)
        for node in range(agent.rendezvous.nnodes)
        if node not in agent.reports
    ]
    if agent.reports and missing:
        return f" (after the last failure, node {', '.join(missing)} sent no report)"
    return ""


def _leave(cfg: RunConfig, agent: LockstepAgent, others_may_read: bool) -> None:
    """Close the rendezvous; node 0 (the store's host) first lets readers of its store leave."""
    if agent.store_lost:
        return
    alive = cfg.nnodes
    if agent.reports:  # a node that sent no report in the last round is not reading either
        alive = len(agent.reports)
    wait_s = GRACE_S if cfg.node_rank == 0 and others_may_read else 0.0
    try:
        group.leave(agent.rendezvous, alive, wait_s)
        agent.rendezvous.shutdown()
    except Exception as error:  # the store may be gone (node 0 left first)
        log.debug("leaving the rendezvous: %s", error)


# The two watches share one folder with the workers: their progress records, and on
# SIGUSR2 their stacks (read by both the stall watch and the exit watch).
def stall_watch(cfg: RunConfig, directory: Path) -> StallWatch | None:
    """The workers' progress watch (None with --stall-timeout 0); the folder is exported."""
    if not cfg.stall_timeout_s:
        return None
    directory.mkdir(exist_ok=True)
    os.environ[progress.DIR_VARIABLE] = str(directory)
    watch = StuckReplacer if cfg.replace_stuck else StallWatch  # `launch/recovery/stuck.py`
    return watch(directory, cfg.stall_timeout_s, cfg.nnodes)


def exit_watch(cfg: RunConfig, directory: Path) -> ExitWatch:
    """The bound on a worker's exit after its script ended; the folder is exported too."""
    directory.mkdir(exist_ok=True)
    os.environ[EXIT_DIR_VARIABLE] = str(directory)
    return ExitWatch(directory, cfg.exit_grace_s)
