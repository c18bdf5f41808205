"""The elastic agent with whole-group failover: one node's failure restarts every node.

`LockstepAgent` is torch.distributed.elastic's `LocalElasticAgent` (spawn, watch,
stop, rendezvous, restart loop) with one addition in its watch step: after
checking its own workers it checks the rendezvous store for other nodes' reports
and for nodes that stopped beating (`lockstep.launch.supervise.group`). Any of these ends
the round on every node: each node stops its workers, posts its report, waits a
moment for the others' reports, and either restarts into a fresh rendezvous round
(every node counts the same restart) or, with no restarts left, gives up.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from lockstep.launch.diagnostics.report import describe, restart_line
from lockstep.launch.recovery import LiveRecovery
from lockstep.launch.rendezvous.flood import StoreFloodError
from lockstep.launch.rendezvous.foreign import SECURITY_DOC, WINDOW_S
from lockstep.launch.rendezvous.rounds import LockstepRendezvous
from lockstep.launch.rendezvous.store import StoreLostError, StoreUnreachable
from lockstep.launch.supervise import group
from lockstep.launch.watches.exits import ExitWatch, ended_path
from lockstep.launch.watches.stall import StallWatch
from lockstep.launch.watches.watchdog import Watchdog
from lockstep.live import sealed

log = logging.getLogger("lockstep.run")
BEAT_S = 1.0


class LockstepAgent(LocalElasticAgent):
    """A `LocalElasticAgent` that propagates failures to, and learns them from, other nodes.

    Args:
        *args, **kwargs: as for `LocalElasticAgent` (spec, logs_specs, ...).
        grace_s: how long a node waits for the other nodes' reports after a failure.
        silence_s: a node whose heartbeat stalls this long is declared lost.
        rdzv_timeout_s: the rendezvous' join timeout (how long joining may take).
        watchdog: told of every step forward, so a store that hangs ends the launcher.
        stalls: the workers' progress watch (`lockstep.launch.watches.stall`); None: off.
        exits: the bound on a worker's exit after its script (`lockstep.launch.watches.exits`).
        recovery: live recovery (`launch/recovery/`): a lost worker replaced in place, a
            lost node waited for; None: off.

    torch's agent keeps the worker group, its process context and the restarts left in
    private members (torch 2.13, `SimpleElasticAgent`): `worker_group`,
    `workers_context` and `remaining_restarts` are the one place they are read or set
    (tests/launch/test_agent_adapter.py checks torch still has them).
    """

    def __init__(
        self,
        *args: Any,
        grace_s: float,
        silence_s: float,
        rdzv_timeout_s: float,
        watchdog: Watchdog,
        stalls: StallWatch | None = None,
        exits: ExitWatch | None = None,
        recovery: LiveRecovery | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.recovery = recovery
        self.beat_floor = 0  # a node that took a lost node's place counts on from its beats
        self._stalls = stalls
        self._exits = exits
        self._watchdog = watchdog
        self._rdzv_timeout_s = rdzv_timeout_s
        self.rendezvous: LockstepRendezvous = self._worker_group.spec.rdzv_handler
        self._grace_s = grace_s
        self._silence_s = silence_s
        self._posted = False
        self._done_since: float | None = None
        self.store_lost = False
        self.reports: dict[int, group.NodeReport] = {}
        self._beats: dict[int, tuple[int, float]] = {}
        self._stop_beating = threading.Event()
        threading.Thread(target=self._beat, name="lockstep-heartbeat", daemon=True).start()

    @property
    def node_rank(self) -> int:
        return self.rendezvous.me.node_rank

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    # ------------------------------------------- torch's internals, read in one place
    @property
    def worker_group(self) -> WorkerGroup:
        """This node's workers (torch's `_worker_group`)."""
        return self._worker_group

    @property
    def workers_context(self) -> Any:
        """The running workers' process context (torch's `_pcontext`; None between rounds)."""
        return self._pcontext

    @property
    def remaining_restarts(self) -> int:
        """Whole-group restarts left (torch's `_remaining_restarts`)."""
        return self._remaining_restarts

    @remaining_restarts.setter
    def remaining_restarts(self, count: int) -> None:
        self._remaining_restarts = count

    def _beat(self) -> None:
        """Post a sealed, ever-growing count under this job's and round's key: a stranger
        can neither fake it nor replay one of another job or round."""
        key = group.ALIVE_KEY.format(node=self.node_rank)
        beat = 0
        while not self._stop_beating.wait(BEAT_S):
            beat = max(beat, self.beat_floor) + 1
            try:
                self.rendezvous.put(key, beat)
            except StoreUnreachable:  # the watch step reports it, and the store is dialed again
                continue

    def close(self) -> None:
        """Stop the heartbeat thread and the idle spares (the launcher is about to leave)."""
        self._stop_beating.set()
        if self.recovery is not None:
            self.recovery.close()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # The join's last store call may start just before its deadline and wait for two.
        allow = self._rdzv_timeout_s + 2 * self.rendezvous.store.op_timeout_s
        self._watchdog.pet("joining the rendezvous", allow)
        super()._rendezvous(worker_group)
        # what the workers seal live recovery's values for: this launch and this round
        os.environ.update(sealed.variables(self.rendezvous.job, self.rendezvous.round))
        self._watchdog.pet("starting the workers")
        if self.rendezvous.round > self.restart_count:  # node 0 was started again
            spent = self.rendezvous.round
            self._remaining_restarts = max(0, worker_group.spec.max_restarts - spent)
            log.warning("the job is in round %d: %d restart(s) already spent", spent, spent)
        self._posted = False
        self._done_since = None
        self.reports = {}
        self._beats = {}
        if self._stalls is not None:
            self._stalls.reset()
        if self._exits is not None:
            self._exits.reset()
        if self.recovery is not None:
            self.recovery.reset()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        rejoin = self.rendezvous.rejoin  # in a lost node's place (`launch/recovery/rejoin.py`)
        if rejoin is not None and rejoin.taken:
            return rejoin.start(self, worker_group, super()._start_workers)
        return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._watchdog.pet("stopping the workers", self._shutdown_timeout)
        # torch's _stop_workers waits its own default (30 s) before SIGKILL; ours is the
        # run's shutdown timeout (a frozen worker cannot act on SIGTERM, so it waits it all).
        self._shutdown(timeout=self._shutdown_timeout)
        self._watchdog.pet("stopped the workers")

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # A store call may wait for the heartbeat's call, each bounded by the store's bound.
        self._watchdog.pet("watching the workers", 2 * self.rendezvous.store.op_timeout_s + 5)
        if self.recovery is not None and self.recovery.check(self):  # before torch's poll
            result = RunResult(state=WorkerState.HEALTHY)  # polled after the next check
        else:
            result = super()._monitor_workers(worker_group)
        try:
            return self._watch_group(worker_group, result)
        except StoreUnreachable as error:
            return self._store_lost(error)

    def _store_lost(self, error: StoreUnreachable) -> RunResult:
        """Node 0's store did not answer: end the round and rejoin, or give up with no restarts."""
        master = self.rendezvous.nodes.get(0)
        between = f"node {self.node_rank} ({self.rendezvous.me.addr}) and node 0" + (
            f" ({master.addr})" if master else ""
        )
        if self.recovery is not None:  # a live job: say why it is not recovered live
            self.recovery.store_lost(self._remaining_restarts)
        if self._remaining_restarts == 0 or self.node_rank == 0:
            self.store_lost = True
            raise StoreLostError(self.rendezvous.endpoint, error, between) from None
        log.error("%s: the network between %s may be cut; rejoining", error, between)
        self._end_round(f"lost the rendezvous store ({error})", [], reachable=False)
        return RunResult(state=WorkerState.FAILED)

    def _watch_group(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        if self._exits is not None:
            result = self._exits.excuse(result, worker_group.workers)
            if result.state == WorkerState.HEALTHY:
                self._exits.check(worker_group.workers)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            if self.recovery is not None:
                self.recovery.explain(self)
            host = self.rendezvous.me.host
            early = self._early_exits(worker_group)  # stopped in their teardown, if at all
            failures = [
                early.pop(rank, None) or describe(rank, failure, self.node_rank, host)
                for rank, failure in sorted(result.failures.items())
            ]
            self._end_round("workers failed", failures + list(early.values()))
        elif result.state == WorkerState.HEALTHY:
            cause = self._peer_trouble(worker_group)
            if cause:
                self._end_round(cause, list(self._early_exits(worker_group).values()))
                return RunResult(state=WorkerState.FAILED)
            waiting = self.recovery is not None and self.recovery.waiting
            if self._stalls is not None and not waiting:
                return self._check_stall(worker_group, result)
        elif result.state == WorkerState.SUCCEEDED and self.rendezvous.nnodes > 1:
            return self._finished(worker_group, result)
        return result

    def _finished(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """This node's workers all succeeded: keep watching until every node's did.

        A rank that leaves early (`sys.exit(0)`) may be a node's only worker: its node
        would otherwise wait at torch's exit barrier while its peers fail with the echo
        ("Connection closed by peer"), and no report would name it. Here a peer's report
        (or silence) ends the round with this node's finished workers in the report.
        """
        if self._done_since is None:
            self.rendezvous.put(group.DONE_KEY.format(node=self.node_rank), True)
            self._done_since = time.monotonic()
        waited = time.monotonic() - self._done_since
        if waited > self._exit_barrier_timeout or group.all_done(
            self.rendezvous, self.rendezvous.nnodes
        ):
            return result
        cause = self._peer_trouble(worker_group)
        if not cause:
            return RunResult(state=WorkerState.HEALTHY)
        self._end_round(cause, list(self._early_exits(worker_group).values()))
        return RunResult(state=WorkerState.FAILED)

    def _early_exits(self, worker_group: WorkerGroup) -> dict[int, group.WorkerFailure]:
        """This node's workers whose script ended well (the bootstrap's note), by rank."""
        if self._exits is None:
            return {}
        found = {}
        for worker in worker_group.workers:
            note = ended_path(self._exits.directory, worker.local_rank)
            if not note.exists():
                continue
            found[worker.global_rank] = group.WorkerFailure(
                rank=worker.global_rank,
                local_rank=worker.local_rank,
                node_rank=self.node_rank,
                host=self.rendezvous.me.host,
                pid=worker.id or 0,
                how=group.LEFT_EARLY,
                message=group.EARLY_MESSAGE,
                detected=note.stat().st_mtime,
            )
        return found

    def _check_stall(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """End the round when the workers stopped progressing (`lockstep.launch.watches.stall`)."""
        assert self._stalls is not None
        stall = self._stalls.check(worker_group.workers, self.node_rank, self.rendezvous.me.host)
        if stall is None:
            return result
        log.error("%s", stall.message)
        self._end_round("workers stalled", stall.failures)
        return RunResult(state=WorkerState.FAILED)

    def _peer_trouble(self, worker_group: WorkerGroup) -> str | None:
        """Why this node should stop although its own workers are fine, or None."""
        try:
            self.rendezvous.watch()  # a late node claimed a rank already held: it raises
        except StoreFloodError as error:  # node 0: stop every node, for good, saying why
            log.error("%s", error)
            self._end_round(str(error), [], final=True)
            return str(error)
        reports = group.read_reports(self.rendezvous, self.rendezvous.nnodes)  # sealed only
        if reports:
            self.reports = reports  # kept should the store go before the exchange
            return "stopped its workers after a failure on another node"
        lost = self._silent_nodes()
        if self.recovery is not None:  # a live job waits for a lost node (`recovery/nodes.py`)
            lost = self.recovery.judge(self, lost)
        if lost:
            return self._lost_line(lost)
        return None

    def _lost_line(self, lost: list[int]) -> str:
        """Why `lost` count as lost: silence, or a heartbeat that others overwrote."""
        nodes = ", ".join(map(str, lost))
        heard = f"lost node {nodes}: no heartbeat for {self._silence_s:.0f} s"
        keys = [self.rendezvous.key(group.ALIVE_KEY.format(node=node)) for node in lost]
        tampered = sum(self.rendezvous.foreign.count(key) for key in keys)
        if tampered:
            return (
                f"{heard}, but its heartbeat ({', '.join(keys)}) was overwritten or deleted "
                f"{tampered} time(s) in the last {WINDOW_S:.0f} s by something other than the "
                "job: a host on the network writes into the launchers' store (the network may "
                f"be fine); allow the store's port to the training nodes only ({SECURITY_DOC})"
            )
        return (
            f"{heard} (the network between node {self.node_rank} ({self.rendezvous.me.addr}) "
            f"and {self._describe_nodes(lost)} failed, or it stopped)"
        )

    def _describe_nodes(self, nodes: list[int]) -> str:
        known = self.rendezvous.nodes
        return ", ".join(
            f"node {n} ({known[n].addr})" if n in known else f"node {n}" for n in nodes
        )

    def silence(self, node: int) -> float:
        """Seconds since node `node`'s heartbeat last advanced (0.0 before any was seen)."""
        return time.monotonic() - self._beats.get(node, (0, time.monotonic()))[1]

    def _silent_nodes(self) -> list[int]:
        now = time.monotonic()
        silent = []
        for node in range(self.rendezvous.nnodes):
            if node == self.node_rank:
                continue
            count = self.rendezvous.take(group.ALIVE_KEY.format(node=node))
            last_count, since = self._beats.get(node, (-1, now))
            if isinstance(count, int) and count > last_count:  # a replayed beat is no news
                self._beats[node] = (count, now)
            elif now - since > self._silence_s:
                silent.append(node)
        return silent

    def _end_round(
        self,
        cause: str,
        failures: list[group.WorkerFailure],
        final: bool = False,
        reachable: bool = True,
    ) -> None:
        """Stop local workers, post this node's report once, gather everyone's (unless final).

        `reachable=False`: the store just did not answer, so do not wait on it again.
        """
        if self._posted:
            return
        self._stop_workers(self._worker_group)
        me = self.rendezvous.me
        report = group.NodeReport(me.node_rank, me.host, me.addr, cause, failures, final)
        grace = 0.0 if final else self._grace_s
        self._watchdog.pet("exchanging failure reports", 3 * self.rendezvous.store.op_timeout_s)
        self._posted = True
        try:
            if not reachable:
                raise StoreUnreachable(f"the store at {self.rendezvous.endpoint} did not answer")
            group.post(self.rendezvous, report)
            gathered = group.gather(self.rendezvous, self.rendezvous.nnodes, grace)
            self.reports = {**gathered, me.node_rank: report}  # its own, even if deleted there
        except StoreUnreachable as error:  # cut off: the others learn it from the silence
            log.warning("could not exchange failure reports: %s", error)
            self.reports = {**self.reports, me.node_rank: report}  # and those read before
        if any(r.final for r in self.reports.values()):
            self._remaining_restarts = 0  # a node that was stopped will not come back

    def announce_stop(self, cause: str) -> None:
        """Tell the other nodes that this node stops for good (a signal); never raises."""
        try:
            if self._worker_group.store is not None:
                self._end_round(cause, [], final=True)
        except Exception as error:  # the store may be gone already
            log.debug("could not announce the stop: %s", error)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Ctrl-C reaches only the launcher (workers run in their own sessions); stop the
        # workers with SIGTERM, which ends a Python process even inside a collective.
        if death_sig == signal.SIGINT:
            death_sig = signal.SIGTERM
        self._watchdog.pet("stopping the workers", timeout)
        super()._shutdown(death_sig, timeout)

    def _exit_barrier(self) -> None:
        self._watchdog.pet("waiting for the other nodes to finish", self._exit_barrier_timeout)
        super()._exit_barrier()

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        restart = self.restart_count  # the caller has counted this restart already
        spec = worker_group.spec
        log.warning(restart_line(self.reports, self.rendezvous.nnodes, restart, spec.max_restarts))
        super()._restart_workers(worker_group)
