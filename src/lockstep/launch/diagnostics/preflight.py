"""Checks before launching: can this node find the master, and is it who it claims to be.

Run by every node before the rendezvous, so a wrong address, a closed port or a
firewall fails in seconds with a message that names the node, the address and
the port, and says what to check, instead of a hang or a C++ trace. Node 0 checks
that the master address is one of its own and that the port is free; the others
wait (up to the rendezvous timeout) for the master's port to answer, then check
within seconds that what answers is a store (not some other program).
"""

from __future__ import annotations

import errno
import logging
import socket
import time

from lockstep.errors import LockstepError
from lockstep.launch.cli.config import RunConfig
from lockstep.launch.rendezvous.netif import Route, is_loopback, resolve, route_to
from lockstep.launch.rendezvous.store import BoundedStore, StoreUnreachable

log = logging.getLogger("lockstep.run")
PROBE_TIMEOUT_S = 2.0
STORE_PROBE_S = 3.0  # a store answers at once (a few ms over a slow link); a foreign program never
_CHECK = (
    "Check that node 0 runs `lockstep run` with the same --master-port, that {addr} is node "
    "0's address on a network this node reaches (`ip route get {ip}`), and that no firewall "
    "blocks TCP port {port} (or the ports gloo/NCCL open) between the nodes."
)


class PreflightError(LockstepError):
    """A node cannot take part: the message says which node, which address, what to check."""


def master_ip(cfg: RunConfig) -> str:
    """The master address, resolved to an IP; raises PreflightError when it does not resolve."""
    try:
        return resolve(cfg.master_addr)
    except (socket.gaierror, UnicodeError) as error:
        raise PreflightError(
            f"node {cfg.node_rank} cannot resolve the master address {cfg.master_addr!r} "
            f"({error}). Check --master-addr (under Slurm: MASTER_ADDR or the job's nodelist) "
            "and this node's DNS or /etc/hosts; an IP address avoids the lookup."
        ) from None


def local_route(cfg: RunConfig, ip: str) -> Route:
    """This node's address and interface towards the master (or --local-addr if given)."""
    try:
        route = route_to(ip, cfg.local_addr)
    except OSError as error:
        raise PreflightError(
            f"node {cfg.node_rank} has no route to the master {cfg.master_addr} ({ip}): "
            f"{error.strerror or error}. Check this node's interfaces and routes "
            f"(`ip route get {ip}`), or pass --local-addr."
        ) from None
    if cfg.nnodes > 1 and is_loopback(resolve(route.local_addr)) and not is_loopback(ip):
        raise PreflightError(
            f"node {cfg.node_rank} would be reached at the loopback address "
            f"{route.local_addr}; other nodes cannot dial it. Pass --local-addr with this "
            "node's address on the network the nodes share."
        )
    return route


def check_master_port(cfg: RunConfig, ip: str) -> None:
    """On node 0: the master address is this machine's, and the port is free."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, cfg.master_port))
        except OSError as error:
            raise PreflightError(_bind_message(cfg, ip, error)) from None


def _bind_message(cfg: RunConfig, ip: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return (
            f"node 0 cannot host the rendezvous: port {cfg.master_port} on {cfg.master_addr} "
            f"({ip}) is already in use, probably by another job or an earlier run. Pick "
            "another --master-port, or stop the process that holds it."
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return (
            f"node 0 hosts the rendezvous, but the master address {cfg.master_addr} ({ip}) is "
            "not an address of this machine. Start node 0 on the machine that owns it, or "
            "pass this machine's address as --master-addr (and check --node-rank)."
        )
    return f"node 0 cannot listen on {cfg.master_addr}:{cfg.master_port} ({ip}): {error}"


def wait_for_master(cfg: RunConfig, ip: str, timeout_s: float) -> None:
    """On nodes other than 0: wait until the master's port accepts a TCP connection.

    Raises:
        PreflightError: it did not within `timeout_s`; the message says what to check.
    """
    deadline = time.monotonic() + timeout_s
    waiting_logged = False
    while True:
        try:
            with socket.create_connection((ip, cfg.master_port), timeout=PROBE_TIMEOUT_S):
                pass
            return check_store_answers(cfg, ip)
        except OSError as error:
            last = error.strerror or str(error) or type(error).__name__
        if time.monotonic() >= deadline:
            break
        if not waiting_logged:
            log.info("waiting for the master at %s:%d (%s)", ip, cfg.master_port, last)
            waiting_logged = True
        time.sleep(0.5)
    check = _CHECK.format(addr=cfg.master_addr, ip=ip, port=cfg.master_port)
    raise PreflightError(
        f"node {cfg.node_rank} cannot reach the master at {cfg.master_addr}:{cfg.master_port} "
        f"({ip}) after {timeout_s:.0f} s: {last}. {check}"
    )


def check_store_answers(cfg: RunConfig, ip: str) -> None:
    """What listens on the master port answers as a store within seconds.

    Raises:
        PreflightError: it does not (another program holds the port, or node 0 is frozen).
    """
    probe = BoundedStore(ip, cfg.master_port, STORE_PROBE_S)
    try:
        probe.call("check", ["lockstep/probe"])
    except StoreUnreachable as error:
        raise PreflightError(
            f"node {cfg.node_rank}: the rendezvous store at {cfg.master_addr}:"
            f"{cfg.master_port} does not answer ({error}): something accepts TCP "
            "connections on that port but is not node 0's `lockstep run` (another program "
            "listens there, or node 0 is frozen). Check --master-addr and --master-port, "
            "and what listens on that port on node 0 (`ss -ltnp`)."
        ) from None
    finally:
        probe.close()


def find_route(cfg: RunConfig) -> tuple[str, Route]:
    """The master's IP, and this node's address and interface towards it."""
    ip = master_ip(cfg)
    return ip, local_route(cfg, ip)


def check_master(cfg: RunConfig, ip: str) -> None:
    """Node 0: the master address is its own and the port free; others: the port answers."""
    if cfg.node_rank == 0 and cfg.master_port != 0:
        check_master_port(cfg, ip)
    elif cfg.node_rank != 0:
        wait_for_master(cfg, ip, cfg.rdzv_timeout_s)
