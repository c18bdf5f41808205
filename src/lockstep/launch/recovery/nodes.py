"""A lost node under live recovery: the other nodes keep their workers and wait for it.

Without live recovery, a node whose heartbeat stops ends the round on every node
(`agent.py`). With `--live-recovery` on several nodes, node 0's launcher, which hosts
the stores, decides for every node (`NodeWatch.judge`, called where the agent looks
for silent nodes). It declares node K lost after the silence bound, or as soon as a
new `lockstep run --node-rank K` asks to come in (`rejoin.py`) while K has been
silent for REJOIN_SILENCE_S. If every rank declared itself recoverable and no
generation is forming, it posts an invitation (sealed, in the rendezvous round) and
waits up to --rejoin-timeout for a joiner to take it; the survivors' workers wait
in their step meanwhile. A joiner that takes it starts K's ranks in a new
generation; if none comes in time, the invitation is closed (compare-and-set, so a
late joiner and the deadline cannot both win) and the round ends: the whole-group
restart, or the end of the job with what to start, in one line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from lockstep.launch.recovery import generations
from lockstep.launch.recovery.rejoin import swap
from lockstep.launch.recovery.replacer import STORE_TIMEOUT_S
from lockstep.live import keys, lines

LockstepAgent = Any  # `agent.LockstepAgent`, which imports this module

log = logging.getLogger("lockstep.run")
REJOIN_SILENCE_S = 3.0  # a node silent this long may be replaced by one that asks
ANNOUNCE_MARGIN_S = 30.0


@dataclass
class _Wait:
    serial: int
    since: float  # monotonic, when it was declared lost


class NodeWatch:
    """Node 0's watch over the other nodes of a live job (the others defer to it).

    Args:
        rejoin_timeout_s: how long a lost node's place is kept open (--rejoin-timeout).
        silence_s: the agent's bound on a node's silence (its heartbeat).
    """

    def __init__(self, rejoin_timeout_s: float, silence_s: float) -> None:
        self.rejoin_timeout_s = rejoin_timeout_s
        self.silence_s = silence_s
        self.waiting: dict[int, _Wait] = {}
        self.rejoined: list[tuple[int, float]] = []  # (node, seconds from lost to taken)
        self._serials: dict[int, int] = {}
        self._answered: dict[int, Any] = {}  # node -> the last request acted on
        self._back: dict[int, float] = {}  # node -> when it rejoined (its beats resume)
        self._store: Any = None

    def reset(self) -> None:
        """A new rendezvous round: nothing lost, a new worker store."""
        self.waiting, self._back, self._answered, self._store = {}, {}, {}, None

    def judge(self, agent: LockstepAgent, silent: list[int]) -> list[int]:
        """The nodes whose loss ends the round now; the others are waited for."""
        if agent.node_rank != 0:
            return [node for node in silent if node == 0]  # node 0 decides for the others
        lost = self._follow(agent)
        for node, why in self._newly_lost(agent, silent, set(lost)):
            reason = self._refusal(agent)
            if reason is not None:
                log.warning("%s", lines.not_possible(f"node {node} {why}, and {reason}"))
                lost.append(node)
            else:
                self._invite(agent, node, why)
        return lost

    def _newly_lost(
        self, agent: LockstepAgent, silent: list[int], skip: set[int]
    ) -> list[tuple[int, str]]:
        now, found = time.monotonic(), []
        for node in range(1, agent.rendezvous.nnodes):
            if node in self.waiting or node in skip:
                continue
            if now - self._back.get(node, -1e9) < self.silence_s:
                continue
            request = agent.rendezvous.take(keys.REJOIN_REQUEST.format(node=node))
            quiet = agent.silence(node)
            if node in silent:
                found.append((node, f"was lost (no heartbeat for {quiet:.0f} s)"))
            elif request and request != self._answered.get(node) and quiet >= REJOIN_SILENCE_S:
                self._answered[node] = request
                found.append(
                    (
                        node,
                        f"was lost (no heartbeat for {quiet:.0f} s; a new one asks"
                        " to take its place)",
                    )
                )
        return found

    def _refusal(self, agent: LockstepAgent) -> str | None:
        """Why the survivors cannot wait for a lost node live, or None."""
        group = agent.worker_group
        world_size = group.workers[0].world_size
        try:
            store = self._worker_store(group)
            forming = generations.claim_refusal(store, world_size)
            return forming or generations.declared_refusal(store, world_size)
        except RuntimeError as error:
            return f"the worker store did not answer ({error})"

    def _invite(self, agent: LockstepAgent, node: int, why: str) -> None:
        serial = self._serials[node] = self._serials.get(node, 0) + 1
        nproc = len(agent.worker_group.workers)
        ranks = list(range(node * nproc, (node + 1) * nproc))
        invitation = {"serial": serial, "ranks": ranks}
        agent.rendezvous.put(keys.REJOIN_INVITE.format(node=node), invitation)
        self.waiting[node] = _Wait(serial, time.monotonic())
        log.warning(
            "node %d %s: live recovery keeps the other nodes' workers waiting up to %.0f s "
            "(--rejoin-timeout) for `lockstep run --node-rank %d` with the job's arguments to "
            "take ranks %d-%d",
            node,
            why,
            self.rejoin_timeout_s,
            node,
            ranks[0],
            ranks[-1],
        )

    def _follow(self, agent: LockstepAgent) -> list[int]:
        """Nodes waited for: rejoined (stop waiting), or past the deadline (lost: returned)."""
        lost = []
        for node, wait in list(self.waiting.items()):
            name = keys.REJOIN_TAKEN.format(node=node, serial=wait.serial)
            taken = agent.rendezvous.take(name)
            waited = time.monotonic() - wait.since
            if taken is None and waited > self.rejoin_timeout_s:
                taken = swap(agent.rendezvous, name, "expired")
            if taken is None:
                continue
            del self.waiting[node]
            if taken == "expired":
                log.warning("%s", self._expired_line(agent, node))
                lost.append(node)
                continue
            self._back[node] = time.monotonic()
            self.rejoined.append((node, waited))
            log.warning(
                "node %d rejoined %.2f s after it was declared lost; its workers "
                "are restored from live peers",
                node,
                waited,
            )
        return lost

    def _expired_line(self, agent: LockstepAgent, node: int) -> str:
        timeout = (
            f"node {node} did not rejoin within {self.rejoin_timeout_s:.0f} s (--rejoin-timeout)"
        )
        if agent.remaining_restarts > 0:
            return lines.not_possible(timeout) + (
                f", which waits up to --rdzv-timeout for every node: start `lockstep run "
                f"--node-rank {node}` with the job's arguments"
            )
        return lines.not_possible(timeout, restarts_left=False)

    def store_lost(self, remaining_restarts: int) -> None:
        """Node 0 (the stores' host) is lost: the one line saying why nothing is live."""
        reason = "node 0 was lost, and its launcher hosts the stores of the job's generations"
        log.warning("%s", lines.not_possible(reason, restarts_left=remaining_restarts > 0))

    def _worker_store(self, group: Any) -> Any:
        if self._store is None:
            addr, port = str(group.master_addr), int(group.master_port or 0)
            self._store = generations.client(addr, port, STORE_TIMEOUT_S)
        return self._store
