"""lockstep's rendezvous: the nodes meet in rounds, in sealed JSON, at node 0's store.

torch's dynamic c10d rendezvous keeps its state in the store as a pickle, which
anyone who reaches the port can replace (and so run code in every launcher). Here
the state is a few values sealed with the job's secret (`launch/rendezvous/secret.py`):
node 0 opens round r (`open`: the round and the address of the round's fresh
worker store, which node 0's launcher hosts on its own address only), every node
claims its --node-rank in that round (`node/K`, compare-and-set, so a second claim
of the same rank is caught at once and ends every node), and the round starts
when all nodes have claimed. A node that lost the store (a network cut) dials
again until the join timeout, so it rejoins the next round when the cut heals.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from lockstep.launch.rendezvous.secret import Signer
from lockstep.launch.rendezvous.store import BoundedStore, StoreUnreachable, host

log = logging.getLogger("lockstep.run")
POLL_S = 0.2


@dataclass(frozen=True)
class NodeInfo:
    """Who a node is: its --node-rank, host name and address towards the master."""

    node_rank: int
    host: str
    addr: str


class NodeRankRendezvousError(RendezvousError):
    """The nodes that met do not hold distinct --node-rank values in [0, nnodes)."""


class LockstepRendezvous(RendezvousHandler):
    """Rounds of `nnodes` nodes whose group ranks are their --node-rank.

    Args:
        store: a bounded client of the launchers' store (node 0 hosts it).
        signer: seals and opens every value with the job's secret.
        me: this node.
        nnodes: nodes in the job.
        run_id: the job's name in the store.
        join_timeout_s: how long a round may take to fill (at start and after a restart).
    """

    def __init__(
        self,
        store: BoundedStore,
        signer: Signer,
        me: NodeInfo,
        nnodes: int,
        run_id: str,
        join_timeout_s: float,
    ) -> None:
        self.store = store
        self.signer = signer
        self.me = me
        self.nnodes = nnodes
        self.endpoint = store.endpoint
        self.round = -1
        self.nodes: dict[int, NodeInfo] = {}
        self._run_id = run_id
        self._join_timeout_s = join_timeout_s
        self.nonce = secrets.token_hex(16)
        self._worker_server: TCPStore | None = None
        self._closed = False
        self.rejoin: Any = (
            None  # `launch/recovery/rejoin.py`'s Rejoiner, on a live job's nodes but 0
        )

    def key(self, name: str, round_: int | None = None) -> str:
        """The store key of `name` in round `round_` (default: the current one)."""
        return f"lockstep/{self._run_id}/r{self.round if round_ is None else round_}/{name}"

    def put(self, name: str, value: Any) -> None:
        """Store `value`, sealed, under `name` in the current round."""
        key = self.key(name)
        self.store.call("set", key, self.signer.seal(key, value))

    def take(self, name: str) -> Any | None:
        """The sealed value under `name` in the current round; None if absent or forged."""
        key = self.key(name)
        return self.signer.open(key, self.store.read(key))

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._join_timeout_s
        opened = self._retrying(deadline, self.open_round)
        if self.rejoin is not None:  # a live job may be waiting for this node (`rejoin.py`)
            opened = self._retrying(deadline, lambda: self.rejoin.step(self, opened))
        self.round = opened["round"]
        self._retrying(deadline, self._claim)
        self._retrying(deadline, self._wait_for_all)
        addr, port = opened["worker_store"]
        scoped = PrefixStore(self.key("torch/"), self.store.raw())
        workers = RendezvousStoreInfo(addr, port)
        return RendezvousInfo(scoped, self.me.node_rank, self.nnodes, workers)

    def _retrying(self, deadline: float, step: Any) -> Any:
        """Run `step` until it returns a value; a lost store is dialed again until `deadline`."""
        lost: StoreUnreachable | None = None
        while True:
            try:
                found, lost = step(), None
            except StoreUnreachable as error:
                if lost is None:
                    log.warning("%s; dialing again until the join timeout", error)
                lost, found = error, None
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(self._timeout_message(lost))
            time.sleep(POLL_S)

    def open_round(self) -> dict | None:
        """Node 0 opens the next round; the others wait for a round newer than their last."""
        key = f"lockstep/{self._run_id}/open"
        if self.me.node_rank == 0:
            self._worker_server, port = host(self.me.addr, 0, self._join_timeout_s)
            opened = {"round": self.round + 1, "worker_store": [self.me.addr, port]}
            self.store.call("set", key, self.signer.seal(key, opened))
            return opened
        opened = self.signer.open(key, self.store.read(key))
        if isinstance(opened, dict) and int(opened.get("round", -1)) > self.round:
            return opened
        return None

    def _claim(self) -> bool:
        """Claim this node's rank in the round; a rank claimed by another node ends the job."""
        key = self.key(f"node/{self.me.node_rank}")
        mine = self.signer.seal(key, {**asdict(self.me), "nonce": self.nonce})
        current = self.store.call("compare_set", key, "", mine)
        if current.decode() == mine:
            return True
        other = self.signer.open(key, current)
        if other is None:  # not sealed with the job's secret: a stranger wrote it
            log.warning("ignored a forged claim of node %d in the store", self.me.node_rank)
            self.store.call("set", key, mine)
            return True
        message = _duplicate_message(NodeInfo(**_fields(other)), self.me, self.nnodes)
        self.put("abort", message)
        raise NodeRankRendezvousError(message)

    def _wait_for_all(self) -> bool | None:
        aborted = self.take("abort")
        if isinstance(aborted, str):
            raise NodeRankRendezvousError(aborted)
        for node in range(self.nnodes):
            info = self.take(f"node/{node}")
            if not isinstance(info, dict) or info.get("node_rank") != node:
                return None
            self.nodes[node] = NodeInfo(**_fields(info))
        return True

    def _timeout_message(self, lost: StoreUnreachable | None) -> str:
        if lost is not None and self.me.node_rank != 0:
            master = self.nodes.get(0)
            there = f" ({master.addr})" if master else ""
            return (
                f"node {self.me.node_rank} could not reach the rendezvous store on node 0 at "
                f"{self.endpoint} for {self._join_timeout_s:.0f} s ({lost}): the network "
                f"between node {self.me.node_rank} ({self.me.addr}) and node 0{there} failed, "
                "or node 0 stopped"
            )
        missing = [node for node in range(self.nnodes) if node not in self._joined()]
        named = ", ".join(_describe(node, self.nodes.get(node)) for node in missing)
        return (
            f"round {self.round}: node {named} did not join; the network between node "
            f"{self.me.node_rank} ({self.me.addr}) and node {named} failed, or it stopped"
        )

    def _joined(self) -> set[int]:
        try:
            return {n for n in range(self.nnodes) if self.take(f"node/{n}") is not None}
        except StoreUnreachable:
            return set()

    @property
    def use_agent_store(self) -> bool:
        return True  # workers are clients of the round's store that node 0's launcher hosts

    def get_backend(self) -> str:
        return "lockstep"

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # a fixed number of nodes: no one waits to be let in

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        self.store.close()
        return True


def _fields(data: dict) -> dict:
    return {name: data[name] for name in ("node_rank", "host", "addr")}


def _describe(node: int, info: NodeInfo | None) -> str:
    return f"{node} ({info.host}, {info.addr})" if info else str(node)


def _duplicate_message(first: NodeInfo, second: NodeInfo, nnodes: int) -> str:
    return (
        f"two nodes were started with --node-rank {second.node_rank}: {first.host} "
        f"({first.addr}) and {second.host} ({second.addr}); expected each of "
        f"0..{nnodes - 1} exactly once. Fix the --node-rank of one of them."
    )


def build(
    store: BoundedStore, signer: Signer, me: NodeInfo, nnodes: int, run_id: str, timeout_s: float
) -> LockstepRendezvous:
    """The rendezvous of this node at the launchers' store."""
    return LockstepRendezvous(store, signer, me, nnodes, run_id, timeout_s)
