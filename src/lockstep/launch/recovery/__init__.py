"""Live recovery, the launcher's side: `LiveRecovery`, the one object the agent calls.

Under `lockstep run --live-recovery` the agent (`launch/supervise/agent.py`) asks this
object, at each look at its workers, whether a worker that ended can be replaced in
place (`check`), and, where it looks for silent nodes, which of them end the round now
(`judge`). Behind it:

| module | concept |
|---|---|
| `replacer.py` | a lost worker replaced in place, one generation at a time |
| `settle.py` | deaths that come together (two SIGKILLs at once) claimed as one loss |
| `finished.py` | a loss after the peers' scripts ended: the job ends, never restarted |
| `generations.py` | generation numbers claimed once for the whole job (compare-and-set) |
| `spares.py`, `standby.py` | standby workers (`--spares K`) that take a rank at once |
| `forks.py`, `forkserver.py` | the fork server: its child takes a rank no spare took |
| `handover.py` | who takes a lost rank; a process that imported ahead becoming the worker |
| `nodes.py` | node 0's wait for a lost node (`--rejoin-timeout`) |
| `rejoin.py` | a node started again takes the lost node's place |
| `stuck.py` | `--replace-stuck`: the stall watch's stuck worker killed, then replaced |

The workers' side is `lockstep.live`; both read the store keys in `live/keys.py`.
"""

from __future__ import annotations

import os
from typing import Any

from lockstep.launch.cli.config import RunConfig
from lockstep.launch.recovery.forks import ForkServer
from lockstep.launch.recovery.nodes import ANNOUNCE_MARGIN_S, NodeWatch
from lockstep.launch.recovery.rejoin import Rejoiner
from lockstep.launch.recovery.replacer import LiveReplacer
from lockstep.launch.recovery.spares import SparePool
from lockstep.launch.watches.exits import ExitWatch
from lockstep.live.registry import ANNOUNCE_WAIT_VARIABLE

LockstepAgent = Any  # `launch/supervise/agent.py`'s, which imports this module


class LiveRecovery:
    """This node's live recovery: its worker replacer and, on several nodes, its node watch.

    Args:
        replacer: replaces a lost worker and keeps the others.
        nodes: node 0's wait for a lost node (None on one node).
    """

    def __init__(self, replacer: LiveReplacer, nodes: NodeWatch | None) -> None:
        self.replacer = replacer
        self.nodes = nodes

    @classmethod
    def prepare(
        cls, cfg: RunConfig, rendezvous: Any, silence_s: float, exits: ExitWatch | None
    ) -> LiveRecovery | None:
        """The node's live recovery (None without `--live-recovery`). On several nodes, a
        `Rejoiner` for nodes other than 0, and the workers' wait for an announcement,
        longer than a lost node may take."""
        if not cfg.live_recovery:
            return None
        spares = SparePool(cfg.spares) if cfg.spares else None
        replacer = LiveReplacer(spares, exits, ForkServer() if cfg.fork_server else None)
        if cfg.nnodes == 1:
            return cls(replacer, None)
        wait_s = silence_s + cfg.rejoin_timeout_s + ANNOUNCE_MARGIN_S
        os.environ[ANNOUNCE_WAIT_VARIABLE] = str(wait_s)  # the workers inherit it
        if cfg.node_rank != 0:
            rendezvous.rejoin = Rejoiner()
        return cls(replacer, NodeWatch(cfg.rejoin_timeout_s, silence_s))

    @property
    def waiting(self) -> bool:
        """Node 0 waits for a lost node to rejoin (the stall watch pauses meanwhile)."""
        return bool(self.nodes is not None and self.nodes.waiting)

    def reset(self) -> None:
        """A new rendezvous round (a whole-group restart)."""
        self.replacer.reset()
        if self.nodes is not None:
            self.nodes.reset()

    def close(self) -> None:
        """The run is over: end the idle spares and the fork server."""
        self.replacer.close()

    def check(self, agent: LockstepAgent) -> bool:
        """Before torch's poll: True when a lost worker was replaced in place, or while
        the other workers end their script after a loss that ends the job (then no
        whole-group restart is left: the job had finished, `finished.py`)."""
        context = agent.workers_context
        replaced = context is not None and self.replacer.check(context, agent.worker_group)
        if self.replacer.finish is not None:
            agent.remaining_restarts = 0
        return replaced

    def explain(self, agent: LockstepAgent) -> None:
        """torch's poll found a failure: log, once, why it is not recovered live."""
        if agent.workers_context is not None:
            self.replacer.explain(agent.workers_context, agent.worker_group)

    def judge(self, agent: LockstepAgent, silent: list[int]) -> list[int]:
        """Of the `silent` nodes, those whose loss ends the round now."""
        return silent if self.nodes is None else self.nodes.judge(agent, silent)

    def store_lost(self, remaining_restarts: int) -> None:
        """Node 0's store is gone: one line saying why nothing is live."""
        if self.nodes is not None:
            self.nodes.store_lost(remaining_restarts)

    def follow(self, generation: int) -> None:
        """This node's workers were started in `generation` (a rejoined node)."""
        self.replacer.follow(generation)
