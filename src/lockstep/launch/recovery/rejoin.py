"""A node started again while its live job runs: it takes the lost node's place.

`lockstep run --node-rank K ...` started with the job's arguments finds the open
round at node 0's store with rank K already claimed. Without live recovery that is
a duplicated --node-rank and ends the job. Here (`Rejoiner.step`, run by the
rendezvous before its claim) it asks to come in and waits: when node 0 invites it
(`live_nodes.py`: K stopped beating) it takes the invitation with a compare-and-set,
replaces K's claim with its own and joins that round with its worker store. Its
workers then start in a new generation that it claims for K's ranks
(`Rejoiner.start`), and the survivors hand them the state. If K's heartbeat still
advances, the claim is a real duplicate and the rendezvous says so as before; if a
newer round opens (the others gave up and restarted), it joins that one normally.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lockstep.errors import LockstepError
from lockstep.launch.recovery import generations
from lockstep.launch.recovery.replacer import STORE_TIMEOUT_S
from lockstep.launch.supervise.group import ALIVE_KEY
from lockstep.live import group as live_group
from lockstep.live import keys

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from lockstep.launch.rendezvous.rounds import LockstepRendezvous

log = logging.getLogger("lockstep.run")
LockstepAgent = Any  # `agent.LockstepAgent`, which imports this module through live_nodes


def swap(rendezvous: Any, name: str, value: Any, round_: int | None = None) -> Any:
    """Set the sealed `name` (of the round) to `value` unless it is set; returns its value."""
    key = rendezvous.key(name, round_)
    now = rendezvous.store.call("compare_set", key, "", rendezvous.signer.seal(key, value))
    return rendezvous.signer.open(key, now)


class RejoinError(LockstepError):
    """A node took a lost node's place but could not start its workers in the live job."""


class Rejoiner:
    """The rendezvous' step before its claim, and the start of a rejoined node's workers.

    Attributes:
        taken: this node took a lost node's place; its next start is a live one.
        old_beat: the lost node's last heartbeat count (the new one counts on from it).
    """

    def __init__(self) -> None:
        self.taken = False
        self.old_beat = 0
        self._first_beat: int | None = None
        self._asked = False

    def step(self, rdzv: LockstepRendezvous, opened: dict) -> dict | None:
        """The round to claim in (`opened`, or a newer one), or None to look again.

        Runs before the rendezvous takes the round as its own (its heartbeat still
        counts in no round), so every key names the round explicitly.
        """
        current = rdzv.open_round()  # the open round (this node has taken none yet)
        if current is not None and current["round"] > opened["round"]:
            return current
        node, round_ = rdzv.me.node_rank, int(opened["round"])
        held = _read(rdzv, f"node/{node}", round_)
        if not isinstance(held, dict) or held.get("nonce") == rdzv.nonce:
            return opened  # free, or ours: the usual claim
        beat = _read(rdzv, ALIVE_KEY.format(node=node), round_)
        beat = beat if isinstance(beat, int) else 0
        if self._first_beat is None:
            self._first_beat = beat
        elif beat > self._first_beat:
            return opened  # node K still beats: a duplicated --node-rank, the claim says so
        invite = _read(rdzv, keys.REJOIN_INVITE.format(node=node), round_)
        if isinstance(invite, dict):
            return self._take(rdzv, opened, int(invite["serial"]))
        return self._ask(rdzv, round_)

    def _ask(self, rdzv: LockstepRendezvous, round_: int) -> None:
        """Post this launcher's request once (node 0 invites it once K is silent 3 s)."""
        node = rdzv.me.node_rank
        if not self._asked:
            self._asked = True
            _write(rdzv, keys.REJOIN_REQUEST.format(node=node), round_, rdzv.nonce)
            log.warning(
                "node %d is held in round %d by a launcher that may be lost; asking node 0 to "
                "let this one take its place in the running job (live recovery)",
                node,
                round_,
            )
        return None

    def _take(self, rdzv: LockstepRendezvous, opened: dict, serial: int) -> dict | None:
        node, round_ = rdzv.me.node_rank, int(opened["round"])
        mine = {"nonce": rdzv.nonce}
        if swap(rdzv, keys.REJOIN_TAKEN.format(node=node, serial=serial), mine, round_) != mine:
            return None  # closed at its deadline: wait for the round the others open next
        beat = _read(rdzv, ALIVE_KEY.format(node=node), round_)
        self.old_beat = beat if isinstance(beat, int) else 0
        _write(rdzv, f"node/{node}", round_, {**asdict(rdzv.me), "nonce": rdzv.nonce})
        self.taken = True
        log.warning(
            "node %d takes the lost node's place in round %d of the running job", node, round_
        )
        return opened

    def start(
        self, agent: LockstepAgent, group: WorkerGroup, start: Callable[[WorkerGroup], Any]
    ) -> Any:
        """Start this node's workers as live replacements, in a generation claimed for them."""
        self.taken = False
        ranks = [worker.global_rank for worker in group.workers]
        addr, port = str(group.master_addr), int(group.master_port or 0)
        store = generations.client(addr, port, STORE_TIMEOUT_S)
        claimed = generations.claim(store, ranks, group.workers[0].world_size)
        if isinstance(claimed, str):
            raise RejoinError(
                f"node {agent.node_rank} took the lost node's place but cannot start ranks "
                f"{ranks} live: {claimed}. The other nodes fall back to the whole-group restart "
                "at their --rejoin-timeout; start this node again then."
            )
        agent.beat_floor = self.old_beat
        agent.remaining_restarts = max(0, group.spec.max_restarts - agent.rendezvous.round)
        os.environ[live_group.GENERATION_VARIABLE] = str(claimed)
        try:
            result = start(group)
        finally:
            del os.environ[live_group.GENERATION_VARIABLE]
        if agent.recovery is not None:
            agent.recovery.follow(claimed)
        log.warning(
            "node %d rejoined the running job: ranks %s started in generation %d, their state "
            "comes from live peers",
            agent.node_rank,
            ranks,
            claimed,
        )
        return result


def _read(rdzv: LockstepRendezvous, name: str, round_: int) -> Any | None:
    key = rdzv.key(name, round_)
    return rdzv.signer.open(key, rdzv.store.read(key))


def _write(rdzv: LockstepRendezvous, name: str, round_: int, value: Any) -> None:
    key = rdzv.key(name, round_)
    rdzv.store.call("set", key, rdzv.signer.seal(key, value))
