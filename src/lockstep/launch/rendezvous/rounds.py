"""lockstep's rendezvous: the nodes meet in rounds, in sealed JSON, at node 0's store.

torch's dynamic c10d rendezvous keeps its state in the store as a pickle, which
anyone who reaches the port can replace (and so run code in every launcher). Here
the state is a few values sealed with the job's secret (`launch/rendezvous/secret.py`),
under keys that name node 0's nonce for this launch and the round, so a value of
another job or round never opens: node 0 opens round r (`open`: the round, its
nonce, the round's fresh worker store on node 0's address), every node claims its
--node-rank in it (`node/K`, compare-and-set; a second launcher posts a contest that
node 0 judges), and node 0 echoes every claim and launcher nonce under `start` once
all have claimed: a node joins a round only on that echo, so a round replayed from
another job never forms. A node that lost the store dials again until the join
timeout, so it rejoins the next round when a cut heals (or node 0 is started again).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict
from functools import partial
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import (
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from lockstep.launch.rendezvous.claims import (
    NodeInfo,
    NodeRankRendezvousError,
    describe,
    duplicate_message,
    next_round,
    node_of,
    round_of,
)
from lockstep.launch.rendezvous.flood import FloodWatch
from lockstep.launch.rendezvous.foreign import ForeignValues
from lockstep.launch.rendezvous.secret import Opened, Seal, Signer
from lockstep.launch.rendezvous.store import BoundedStore, StoreUnreachable, host

log = logging.getLogger("lockstep.run")
POLL_S = 0.2
WATCH_S = 0.5  # node 0's look at contests and at its `open` while a round runs


class LockstepRendezvous(RendezvousHandler):
    """Rounds of `nnodes` nodes whose group ranks are their --node-rank.

    Args:
        store: a bounded client of the launchers' store (node 0 hosts it).
        signer: seals and opens every value with the job's secret.
        me: this node.
        nnodes: nodes in the job.
        run_id: the job's name in the store.
        join_timeout_s: how long a round may take to fill (at start and after a restart).

    Attributes:
        job: node 0's nonce for this launch (drawn by node 0, learnt from its `open`);
            every key of a round names it, so a value sealed in another job never opens.
        nonce: this launcher's own nonce: node 0 confirms a claim by echoing it.
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
        self.job = secrets.token_hex(8) if me.node_rank == 0 else ""
        self.foreign = ForeignValues(me.node_rank, signer.fingerprint)
        self.flood = FloodWatch(store.endpoint) if me.node_rank == 0 else None
        self._seen_keys: set[str] = set()  # keys read present: one absent later was deleted
        self._formed: tuple[str, int] = ("", -1)  # the last round this node took part in
        self._watched = 0.0
        self._worker_server: TCPStore | None = None
        self._open_sealed = ""
        self._closed = False
        self.rejoin: Any = (
            None  # `launch/recovery/rejoin.py`'s Rejoiner, on a live job's nodes but 0
        )

    def key(self, name: str, round_: int | None = None) -> str:
        """The store key of `name` in round `round_` (default: the current one) of this job."""
        round_ = self.round if round_ is None else round_
        return f"lockstep/{self._run_id}/{self.job}/r{round_}/{name}"

    def put(self, name: str, value: Any) -> None:
        """Store `value`, sealed, under `name` in the current round."""
        key = self.key(name)
        self.store.call("set", key, self.signer.seal(key, value))

    def take(self, name: str) -> Any | None:
        """The sealed value under `name` in the current round; None if absent or not ours."""
        return self._inspect(self.key(name)).value

    def _inspect(self, key: str) -> Opened:
        opened = self.signer.inspect(key, self.store.read(key))
        if opened.seal is not Seal.ABSENT:
            self._seen_keys.add(key)
        elif key in self._seen_keys:  # it was there: someone deleted it
            self.foreign.note(key, Opened(Seal.DELETED))
        self.foreign.note(key, opened)
        return opened

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._join_timeout_s
        while True:
            opened = self._retrying(deadline, self.open_round)
            self._enter(opened)
            if self.rejoin is not None:  # a live job may be waiting for this node (`rejoin.py`)
                opened = self._retrying(deadline, partial(self.rejoin.step, self, opened))
                self._enter(opened)
            self._retrying(deadline, self._claim)
            if self._retrying(deadline, self._wait_for_all) is True:
                break  # else node 0 opened another round meanwhile: join that one
        self._formed = (self.job, self.round)
        addr, port = opened["worker_store"]
        scoped = PrefixStore(self.key("torch/"), self.store.raw())
        workers = RendezvousStoreInfo(addr, port)
        return RendezvousInfo(scoped, self.me.node_rank, self.nnodes, workers)

    def _enter(self, opened: dict) -> None:
        self.job, self.round = opened["job"], opened["round"]

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

    def _open_key(self) -> str:
        return f"lockstep/{self._run_id}/open"

    def open_round(self) -> dict | None:
        """Node 0 opens the next round; the others wait for one newer than their last.

        A node other than 0 takes a round of another job too (node 0 was started
        again), but only node 0's echo of its nonce (`start`) makes it its round.
        """
        key = self._open_key()
        if self.me.node_rank == 0:
            self._worker_server, port = host(self.me.addr, 0, self._join_timeout_s)
            where = [self.me.addr, port]
            opened = {"round": self.round + 1, "job": self.job, "worker_store": where}
            self._open_sealed = self.signer.seal(key, opened)
            self.store.call("set", key, self._open_sealed)
            return opened
        found = self.signer.inspect(key, self.store.read(key))
        opened = self._newer(found.value)
        if opened is None:
            hello = f"lockstep/{self._run_id}/hello/{self.me.node_rank}"
            self.foreign.say_hello(self.store, self.signer, hello, asdict(self.me))
            what = f"the round node 0 opened at {self.endpoint}"
            self.foreign.check_secret("open", found, "node 0", what)
        return opened

    def _newer(self, value: Any) -> dict | None:
        """`value` when it opens a round newer than this node's last: any of another job
        (node 0 was started again, or a replay that node 0 will never confirm), or a
        later one of the same job."""
        opened = round_of(value)
        if opened is None or opened["job"] != self._formed[0]:
            return opened
        return opened if opened["round"] > self._formed[1] else None

    def keep_open(self) -> None:
        """Node 0: put its `open` back when something else was written there (and count it)."""
        key = self._open_key()
        stored = self.store.read(key)
        if self._open_sealed and (stored or b"").decode(errors="replace") != self._open_sealed:
            found = self.signer.inspect(key, stored)
            if found.seal is Seal.OPEN:  # sealed with this secret, but not this launch's round
                found = Opened(Seal.NOT_OURS, None, found.fingerprint)
            self.foreign.note(key, found)
            self.store.call("set", key, self._open_sealed)

    def _claim(self) -> bool:
        """Claim this node's rank in the round; a rank held by another launcher is contested.

        Node 0 judges a contest (`judge_contests`): two launchers in its live round with
        one --node-rank end the job; a round replayed from another job never answers.
        """
        key = self.key(f"node/{self.me.node_rank}")
        claim = {**asdict(self.me), "nonce": self.nonce, "next_round": self._formed[1] + 1}
        mine = self.signer.seal(key, claim)
        current = self.store.call("compare_set", key, "", mine)
        if current.decode(errors="replace") == mine:
            return True
        other = self.signer.inspect(key, current)
        held = node_of(other.value)
        if held is not None and held[1] == self.nonce:  # ours (`rejoin.py` wrote it)
            return True
        if other.seal is not Seal.OPEN:  # not sealed for this round: a stranger wrote it
            self.foreign.note(key, other)
            log.warning("ignored a claim of node %d not sealed for this round", self.me.node_rank)
            self.store.call("set", key, mine)
            return True
        self.put(f"contest/{self.me.node_rank}", {**asdict(self.me), "nonce": self.nonce})
        return True

    def judge_contests(self) -> None:
        """Node 0: end the job when a second launcher contests a claimed --node-rank.

        Raises:
            NodeRankRendezvousError: two launchers hold one --node-rank in this round.
        """
        for node in range(1, self.nnodes):
            contest = node_of(self.take(f"contest/{node}"))
            held = node_of(self.take(f"node/{node}"))
            if contest is None or held is None or contest[1] == held[1]:
                continue
            message = duplicate_message(held[0], contest[0], self.nnodes)
            self.put("abort", message)
            raise NodeRankRendezvousError(message)

    def _check_abort(self) -> None:
        aborted = self.take("abort")
        if isinstance(aborted, str):
            raise NodeRankRendezvousError(aborted)

    def watch(self) -> None:
        """In a running round: every node reads `abort`; node 0, every `WATCH_S`, judges
        contests (a late launcher with a held --node-rank) and keeps its `open` in place.

        Raises:
            NodeRankRendezvousError: a --node-rank is held twice.
            StoreFloodError: node 0's stores hold more than their bounds (`flood.py`).
        """
        self._check_abort()
        self.check_flood()
        if self.me.node_rank == 0 and time.monotonic() - self._watched >= WATCH_S:
            self._watched = time.monotonic()
            self.judge_contests()
            self.keep_open()

    def check_flood(self) -> None:
        """Node 0: the bounds on the keys its stores hold (`flood.py`; raises StoreFloodError)."""
        if self.flood is not None:
            self.flood.look(self.store, self._worker_server)

    def _wait_for_all(self) -> bool | str | None:
        """True once the round formed; "reopened": node 0 opened another; None: not yet."""
        self._check_abort()
        if self.me.node_rank == 0:
            return self._gather_claims()
        if self.rejoin is not None and self.rejoin.taken:  # node 0 echoed the old claim
            return self._read_claims()
        latest = self._newer(self.signer.open(self._open_key(), self.store.read(self._open_key())))
        if latest is not None and (latest["job"], latest["round"]) != (self.job, self.round):
            return "reopened"
        start = self.take("start")
        members = start.get("nodes") if isinstance(start, dict) else None
        if not isinstance(members, dict):
            return None
        mine = node_of(members.get(str(self.me.node_rank)))
        if mine is None or mine[1] != self.nonce:
            return None
        found = {int(n): node_of(info) for n, info in members.items() if str(n).isdigit()}
        self.nodes = {n: info[0] for n, info in found.items() if info is not None}
        return True

    def _read_claims(self) -> bool | None:
        claims = {n: node_of(self.take(f"node/{n}")) for n in range(self.nnodes)}
        if any(claims[n] is None or claims[n][0].node_rank != n for n in claims):
            return None
        self.nodes = {n: claim[0] for n, claim in claims.items() if claim is not None}
        return True

    def _gather_claims(self) -> bool | str | None:
        """Node 0: once every node claimed, echo every claim (and nonce) under `start`."""
        self.check_flood()
        self.keep_open()
        self.judge_contests()
        claims = {n: self.take(f"node/{n}") for n in range(self.nnodes)}
        found = {n: node_of(claim) for n, claim in claims.items()}
        missing = [n for n, claim in found.items() if claim is None]
        for node in missing:
            key = f"lockstep/{self._run_id}/hello/{node}"
            self.foreign.check_hello(self.store, self.signer, key, node, self.endpoint)
        if missing:
            return None
        later = max(next_round(claim) for claim in claims.values())
        if later > self.round:  # node 0 was started again while the others went on
            log.warning(
                "round %d of this launch: node(s) already took part in %d round(s) of the job; "
                "node 0 opens round %d instead, so that every node counts the same restarts",
                self.round,
                later,
                later,
            )
            self.round = later - 1  # the next open is `later`
            return "reopened"
        self.put("start", {"nodes": {str(n): claim for n, claim in claims.items()}})
        self.nodes = {n: claim[0] for n, claim in found.items() if claim is not None}
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
        foreign = self.foreign.where(f"lockstep/{self._run_id}/")
        if self.me.node_rank != 0:
            return self._member_timeout() + foreign
        missing = [node for node in range(1, self.nnodes) if node not in self._joined()]
        named = ", ".join(describe(node, self.nodes.get(node)) for node in missing)
        return (
            f"round {self.round}: node {named} did not join; the network between node "
            f"{self.me.node_rank} ({self.me.addr}) and node {named} failed, or it stopped" + foreign
        )

    def _member_timeout(self) -> str:
        """Why a node other than 0 is not in a round: node 0 opened none, or did not confirm."""
        job, last = self._formed
        if (self.job, self.round) == (job, last) or self.round < 0:
            after = f"newer than round {last}" if last >= 0 else "at all"
            return (
                f"node 0 opened no round {after} at {self.endpoint}: it did not restart its "
                "workers (read its log), or it was started again with another --rdzv-timeout"
            )
        return (
            f"node 0 did not confirm node {self.me.node_rank}'s claim in round {self.round}: "
            "the other nodes did not all join; read node 0's log"
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
