"""The c10d rendezvous of torch.distributed.elastic, with node ranks that follow --node-rank.

The dynamic c10d rendezvous does the membership work (who is in this round, who
waits for the next, timeouts, heartbeats). `NodeRankRendezvous` wraps it to fix
two things seen across real hosts: node ranks come from the user's --node-rank
(so rank = node_rank * nproc_per_node + local_rank, and two nodes claiming the
same rank are caught), and each round gets a fresh worker store (node 0's rank 0
worker hosts it on a new port), so workers restarted into a new round never read
the previous round's addresses from a shared store.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from lockstep.launch.config import RunConfig

NODE_KEY = "lockstep/node/{index}"
WORKER_STORE_KEY = "lockstep/worker_store"
# Keep-alive: a node missing this many beats of this many seconds is dropped from a round.
KEEP_ALIVE_S = 2
KEEP_ALIVE_MISSES = 3


@dataclass(frozen=True)
class NodeInfo:
    """Who a node is: its --node-rank, host name and address towards the master."""

    node_rank: int
    host: str
    addr: str


class NodeRankRendezvousError(RendezvousError):
    """The nodes that met do not hold distinct --node-rank values in [0, nnodes)."""


class NodeRankRendezvous(RendezvousHandler):
    """A dynamic c10d rendezvous whose group ranks are the nodes' --node-rank."""

    def __init__(
        self, inner: RendezvousHandler, store: Store, me: NodeInfo, nnodes: int, endpoint: str
    ) -> None:
        self._inner = inner
        self.endpoint = endpoint
        self.store = store  # the rendezvous store itself, not scoped to a round
        self.me = me
        self.nnodes = nnodes
        self.nodes: dict[int, NodeInfo] = {}

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store = info.store  # scoped to this round
        store.set(NODE_KEY.format(index=info.rank), json.dumps(self.me.__dict__))
        nodes = [
            NodeInfo(**json.loads(store.get(NODE_KEY.format(index=i))))
            for i in range(info.world_size)
        ]
        self.nodes = _check_node_ranks(nodes, self.nnodes)
        if self.me.node_rank == 0:
            store.set(WORKER_STORE_KEY, f"{self.me.addr} {_free_port(self.me.addr)}")
        addr, port = store.get(WORKER_STORE_KEY).decode().split()
        return RendezvousInfo(
            store, self.me.node_rank, info.world_size, RendezvousStoreInfo(addr, int(port))
        )

    @property
    def use_agent_store(self) -> bool:
        return False  # workers build a fresh store each round: see the module docstring

    def get_backend(self) -> str:
        return self._inner.get_backend()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _check_node_ranks(nodes: list[NodeInfo], nnodes: int) -> dict[int, NodeInfo]:
    by_rank: dict[int, NodeInfo] = {}
    for node in nodes:
        other = by_rank.get(node.node_rank)
        if other is not None:
            raise NodeRankRendezvousError(
                f"two nodes were started with --node-rank {node.node_rank}: {other.host} "
                f"({other.addr}) and {node.host} ({node.addr}); expected each of "
                f"0..{nnodes - 1} exactly once. Fix the --node-rank of one of them."
            )
        by_rank[node.node_rank] = node
    return by_rank


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])


def build(cfg: RunConfig, me: NodeInfo) -> NodeRankRendezvous:
    """The rendezvous for this node: node 0 hosts its store at --master-addr:--master-port."""
    # The inner handler would otherwise start a second, shared store for the workers.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"{cfg.master_addr}:{cfg.master_port}",
        run_id=cfg.run_id,
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        local_addr=me.addr,
        is_host=me.node_rank == 0,
        join_timeout=cfg.rdzv_timeout_s,
        last_call_timeout=1,
        close_timeout=10,
        read_timeout=cfg.rdzv_timeout_s,
        keep_alive_interval=KEEP_ALIVE_S,
        keep_alive_max_attempt=KEEP_ALIVE_MISSES,
    )
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    return NodeRankRendezvous(handler, store, me, cfg.nnodes, params.endpoint)
