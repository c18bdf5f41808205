"""Replace a lost worker and keep the others (`lockstep run --live-recovery`).

torch's agent stops every worker once one fails: its process context's poll closes
them all. Before that poll, `LiveReplacer.check` looks at the workers itself. A
worker killed by a signal, whose peers on every node declared themselves recoverable
in the worker store (`lockstep.live.group` keys, posted by `live/registry.py`), is
replaced in place: its generation is claimed and announced in the store, where the
survivors wait for it (`generations.claim`, one number for the whole job), and a new
process starts with the same rank, arguments and environment plus that generation
(with `--spares K`, an idle standby process takes the rank instead: `launch/recovery/spares.py`).
Deaths that come together are claimed together (`settle.py`); a rank lost after its
peers' scripts ended is not replaced, and the job ends without a restart
(`finished.py`). Anything else is left to torch's poll, that is today's whole-group
restart, and the reason is logged in one line.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup

from lockstep.launch.diagnostics.report import scripts_collective
from lockstep.launch.recovery import finished, generations
from lockstep.launch.recovery.settle import settle
from lockstep.launch.recovery.spares import SparePool, start_worker
from lockstep.launch.watches.exits import ExitWatch
from lockstep.live import group as live_group
from lockstep.live import keys, lines, sealed

log = logging.getLogger("lockstep.run")
STORE_TIMEOUT_S = 10.0


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _scripts_collective(pcontext: Any, group: WorkerGroup, failed: dict[int, int]) -> str:
    """'rank 0 failed in a collective of the script's own (torch.distributed.all_gather,
    called at train.py:85 (count)), ...' when a worker that exited with an error was in
    one (its error file, `launch/diagnostics/report.py`), else ''."""
    for local_rank, code in sorted(failed.items()):
        path = getattr(pcontext, "error_files", {}).get(local_rank)
        if code <= 0 or not path:
            continue
        try:
            with open(path) as fp:
                where = scripts_collective(json.load(fp))
        except (OSError, ValueError):
            continue
        if where:
            rank = group.workers[local_rank].global_rank
            return (
                f"rank {rank} failed in a collective of the script's own ({where}), which "
                "live recovery does not run again"
            )
    return ""


def _joined_key(generation: int, rank: int) -> str:
    return keys.JOINED.format(generation=generation, rank=rank)


def _running(pcontext: Any) -> Any:
    """A call that returns local rank -> pid of each worker still running."""
    handlers = pcontext.subprocess_handlers
    return lambda: {lr: h.proc.pid for lr, h in handlers.items() if h.proc.poll() is None}


class LiveReplacer:
    """This node's live replacements, one generation at a time.

    Attributes:
        generation: the last generation announced in this rendezvous round.
        recoveries: (generation, seconds from the death seen to every rank joined).
        finish: set once a rank was lost after its peers' scripts ended: the job ends
            failed, with no restart (`finished.py`).
    """

    def __init__(self, spares: SparePool | None = None, exits: ExitWatch | None = None) -> None:
        self.spares = spares  # standby workers (--spares), taken before a new process
        self.exits = exits  # which workers' scripts ended (`launch/watches/exits.py`)
        self.generation = 0
        self.recoveries: list[tuple[int, float]] = []
        self.finish: finished.Finish | None = None
        self._store: dist.Store | None = None
        self._pending: tuple[int, float] | None = None  # generation in recovery, since when
        self._started: dict[int, str] = {}  # local rank -> its loss, replaced in _pending
        self._unreachable = False  # the worker store stopped answering (logged once)
        self._refused = False  # this round falls back: its reason is logged (once)

    def reset(self) -> None:
        """A new rendezvous round (a whole-group restart): a new worker store, generation 0."""
        self.generation, self._store, self._pending = 0, None, None
        self._unreachable = self._refused = False
        self.finish, self._started = None, {}

    def check(self, pcontext: Any, worker_group: WorkerGroup) -> bool:
        """Replace failed workers live when possible; otherwise leave them to torch's poll.

        Returns:
            True when a worker was replaced: torch's poll waits for the next check, since
            a peer may end while the replacement starts (its reason is logged then).
        """
        try:
            return self._check(pcontext, worker_group, self._failed(pcontext, worker_group))
        except RuntimeError as error:  # the worker store (node 0's launcher) did not answer
            if not self._unreachable:
                self._unreachable = True
                line = str(error).splitlines()[0] if str(error) else type(error).__name__
                self._refuse(f"the worker store did not answer ({line})")
            return False

    def explain(self, pcontext: Any, worker_group: WorkerGroup) -> None:
        """torch's poll found a worker ended after this moment's check: log why, once."""
        failed = self._failed(pcontext, worker_group)
        if self._refused or not failed:
            return
        ranks = [worker_group.workers[lr].global_rank for lr in sorted(failed)]
        reason = self._refusal(pcontext, failed, worker_group)
        self._refuse(reason or f"rank(s) {ranks} ended after the live check")

    def _failed(self, pcontext: Any, group: WorkerGroup) -> dict[int, int]:
        """Local rank -> exit code (negative: the signal) of each worker that ended badly
        while its script ran (after it, its end is the exit watch's: not a loss)."""
        exits = self.exits
        finished = {w.local_rank for w in group.workers if exits and exits.script_ended(w)}
        return {
            local_rank: handler.proc.returncode
            for local_rank, handler in pcontext.subprocess_handlers.items()
            if handler.proc.poll() is not None
            and handler.proc.returncode != 0
            and local_rank not in finished
        }

    def _refuse(self, reason: str) -> None:
        self._refused = True
        log.warning("%s", lines.not_possible(reason))

    def follow(self, generation: int) -> None:
        """This node's workers were started in `generation` (a rejoined node): log its forming."""
        self.generation, self._pending = generation, (generation, time.monotonic())

    def _check(self, pcontext: Any, worker_group: WorkerGroup, failed: dict[int, int]) -> bool:
        world_size = worker_group.workers[0].world_size
        self._check_joined(worker_group, world_size)
        if self.spares is not None:
            self.spares.refill(recovering=self._pending is not None)
        if self.finish is None and not self._refused and (failed or self._pending):
            self._check_finished(pcontext, worker_group, failed)
        if self.finish is not None:
            return self.finish.holding(pcontext)
        if not failed or self._refused:
            return False
        if self._pending is None:  # a death that comes with this one is claimed with it
            failed = settle(lambda: self._failed(pcontext, worker_group), _running(pcontext))
        reason = self._refusal(pcontext, failed, worker_group)
        if reason is not None:
            self._refuse(reason)
            return False
        ranks = [worker_group.workers[lr].global_rank for lr in sorted(failed)]
        store = self._worker_store(worker_group)
        claimed = generations.claim(store, ranks, world_size, known=self.generation)
        if isinstance(claimed, str):
            self._refuse(claimed)
            return False
        self._replace(failed, ranks, pcontext, worker_group, claimed)
        return True

    def _refusal(self, pcontext: Any, failed: dict[int, int], group: WorkerGroup) -> str | None:
        """Why the failed workers cannot be replaced live, in one line, or None."""
        world_size = group.workers[0].world_size
        ranks = [group.workers[lr].global_rank for lr in sorted(failed)]
        declared = self._declared_refusal(group, world_size)
        if declared is not None:  # first: a survivor that cannot wait exits at once
            return declared
        own = _scripts_collective(pcontext, group, failed)  # a survivor met the loss there
        if self._pending is not None:
            generation = self._pending[0]
            during = f"rank(s) {ranks} failed during the live recovery of generation {generation}"
            return f"{during}: {own}" if own else during
        lost = [group.workers[lr].global_rank for lr, code in failed.items() if code < 0]
        if own:
            return f"{own}, after rank(s) {lost} were lost" if lost else own
        for local_rank, code in failed.items():
            if code > 0:
                rank = group.workers[local_rank].global_rank
                return f"rank {rank} {_describe_exit(code)} (an error of the script, not a loss)"
        if len(ranks) == world_size:
            return "no worker survived to hand the state over"
        return None

    def _check_finished(self, pcontext: Any, group: WorkerGroup, failed: dict[int, int]) -> None:
        """A rank lost after a peer's script ended: nothing to recover (`finished.py`).

        Decided once: either before a claim (a rank killed, a peer's script ended), or
        while generation g forms and a peer ends its script without having joined g
        (it never will): then g's replacements on this node are stopped.
        """
        store = self._worker_store(group)
        here = {w.global_rank for w in group.workers if self._script_ended(pcontext, w)}
        peers = finished.ended(store, group.workers[0].world_size, here)
        if self._pending is not None:
            generation = self._pending[0]
            peers = {r for r in peers if sealed.read(store, _joined_key(generation, r)) != 1}
            if not peers:
                return
            ranks = generations.announced(store)[1]
            lost = self._stop_replacements(pcontext, generation)
        else:
            signalled = {lr: code for lr, code in failed.items() if code < 0}
            if not peers or not signalled:
                return  # no peer ended, or an error of the script (the usual fallback)
            ranks = [group.workers[lr].global_rank for lr in sorted(signalled)]
            lost = "; ".join(
                self._loss(group, pcontext, lr, code) for lr, code in signalled.items()
            )
        self.finish = finished.Finish(ranks, finished.reason(lost, ranks, peers - set(ranks)))
        self._refused = True
        log.warning("%s", self.finish.line)

    def _script_ended(self, pcontext: Any, worker: Any) -> bool:
        """Whether this node's `worker` ended its script well (its note, or its exit code 0)."""
        if self.exits is not None and self.exits.script_ended(worker):
            return True
        handler = pcontext.subprocess_handlers.get(worker.local_rank)
        return handler is not None and handler.proc.poll() == 0

    @staticmethod
    def _loss(group: WorkerGroup, pcontext: Any, local_rank: int, code: int) -> str:
        """'rank 1 (pid 812) killed by SIGKILL'."""
        pid = pcontext.subprocess_handlers[local_rank].proc.pid
        return f"rank {group.workers[local_rank].global_rank} (pid {pid}) {_describe_exit(code)}"

    def _stop_replacements(self, pcontext: Any, generation: int) -> str:
        """SIGKILL this node's replacements for `generation`; returns what was lost."""
        stopped = []
        for local_rank, loss in sorted(self._started.items()):
            handler = pcontext.subprocess_handlers[local_rank]
            if handler.proc.poll() is None:
                handler.proc.kill()
            stopped.append(
                f"{loss} (its replacement pid {handler.proc.pid} for generation {generation} "
                "stopped: the peers it waited for had ended)"
            )
        return "; ".join(stopped) or f"rank(s) replaced in generation {generation}"

    def _declared_refusal(self, group: WorkerGroup, world_size: int) -> str | None:
        """The first reason a rank posted for not being recoverable, or None."""
        return generations.declared_refusal(self._worker_store(group), world_size)

    def _replace(
        self,
        failed: dict[int, int],
        ranks: list[int],
        pcontext: Any,
        group: WorkerGroup,
        generation: int,
    ) -> None:
        """Start the failed ranks again in `generation`, which `generations.claim` announced."""
        self.generation = generation
        self._started = {}
        for local_rank, code in sorted(failed.items()):
            old = pcontext.subprocess_handlers[local_rank]
            self._started[local_rank] = self._loss(group, pcontext, local_rank, code)
            env = {
                **pcontext.envs[local_rank],
                live_group.GENERATION_VARIABLE: str(self.generation),
            }
            handler = start_worker(self.spares, pcontext, local_rank, env)
            pcontext.subprocess_handlers[local_rank] = handler
            group.workers[local_rank].id = handler.proc.pid
            log.warning(
                "live recovery: rank %d (pid %d) %s; started pid %d as rank %d, generation %d",
                group.workers[local_rank].global_rank,
                old.proc.pid,
                _describe_exit(code),
                handler.proc.pid,
                group.workers[local_rank].global_rank,
                self.generation,
            )
        self._pending = (self.generation, time.monotonic())

    def close(self) -> None:
        """The run is over: end the idle spares."""
        if self.spares is not None:
            self.spares.close()

    def _check_joined(self, group: WorkerGroup, world_size: int) -> None:
        """Log the end of a recovery once every rank is in the new generation."""
        if self._pending is None:
            return
        generation, since = self._pending
        if not generations.joined(self._worker_store(group), generation, world_size):
            return
        seconds = time.monotonic() - since
        self.recoveries.append((generation, seconds))
        self._pending, self._started = None, {}
        log.warning(
            "live recovery: generation %d formed %.2f s after the replacement started; "
            "no worker restarted",
            generation,
            seconds,
        )

    def _worker_store(self, group: WorkerGroup) -> dist.Store:
        if self._store is None:
            addr, port = str(group.master_addr), int(group.master_port or 0)
            self._store = generations.client(addr, port, STORE_TIMEOUT_S)
        return self._store
