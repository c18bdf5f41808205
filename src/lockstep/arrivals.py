"""Joining the job's default process group, named: which ranks arrived, which never did.

Before the first step every rank waits for the others twice: to reach the launcher's
store, and in `init_process_group` for every rank to join. Both are bounded by
LOCKSTEP_TIMEOUT_S (torch's store and gloo raise past it), but torch's error names a
key, not a rank, and the wait is silent until then. Here each rank posts its arrival
in the launcher's store first, warns every LOCKSTEP_STALL_WARN_S naming the ranks
that have not arrived, and at the bound raises `JoinError` naming them and the store.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lockstep.env import TIMEOUT_VARIABLE, LaunchEnv, read_seconds, read_variable
from lockstep.errors import LockstepError


def join(launch: LaunchEnv, backend: str, init_method: str, timeout: timedelta) -> None:
    """`init_process_group` for `launch`, each rank posting its arrival first (`Arrivals`).

    Raises:
        JoinError: the group did not form within `timeout`, naming the store and the
            ranks that never arrived; or the store was not reached.
    """
    arrivals = Arrivals.post(launch, timeout)
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    except RuntimeError as error:  # torch's store and gloo raise on their timeout
        raise JoinError(_join_failure(launch, timeout, arrivals, error)) from error
    finally:
        if arrivals is not None:
            arrivals.stop()


class JoinError(LockstepError):
    """A rank could not join the job's default process group within its bound."""


ARRIVED_KEY = "lockstep/arrived/{restart}/{rank}"  # in the launcher's store, before the join
JOIN_WARN_VARIABLE = "LOCKSTEP_STALL_WARN_S"  # `runtime/waits.py`'s: the same warning period
DEFAULT_JOIN_WARN_S = 30.0


class Arrivals:
    """Each rank posts its arrival in the launcher's store before it joins the group, so a
    rank that waits says which ranks never came (every JOIN_WARN s, and when its bound,
    LOCKSTEP_TIMEOUT_S, ends the wait), instead of waiting in silence.

    Only where the store is the launcher's (`lockstep run`, torchrun: the agent's
    store, TORCHELASTIC_USE_AGENT_STORE), which exists before any rank joins.
    """

    def __init__(self, launch: LaunchEnv, store: dist.Store, since: float) -> None:
        self.launch, self.store, self.since = launch, store, since
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="lockstep-join", daemon=True).start()

    @classmethod
    def post(cls, launch: LaunchEnv, timeout: timedelta) -> Arrivals | None:
        """Dial the launcher's store and post this rank's arrival (None: not a launcher's
        store). Raises JoinError, naming the store, when it is not reached in `timeout`."""
        if read_variable("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        since = time.monotonic()
        try:
            store = dist.TCPStore(
                launch.master_addr,
                launch.master_port,
                is_master=False,
                timeout=timeout,
                wait_for_workers=False,
            )
            store.set(cls._key(launch, launch.rank), "1")
        except RuntimeError as error:
            raise JoinError(_unreachable(launch, timeout, error)) from error
        return cls(launch, store, since)

    @staticmethod
    def _key(launch: LaunchEnv, rank: int) -> str:
        return ARRIVED_KEY.format(restart=launch.restart_count, rank=rank)

    def missing(self) -> list[int]:
        """The ranks that have not posted their arrival ([] when unknown)."""
        try:
            ranks = range(self.launch.world_size)
            return [r for r in ranks if not self.store.check([self._key(self.launch, r)])]
        except RuntimeError:
            return []

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        every = read_seconds(JOIN_WARN_VARIABLE, DEFAULT_JOIN_WARN_S)
        while not self._stop.wait(every):
            missing = self.missing()
            if not missing:
                return
            waited = time.monotonic() - self.since
            print(
                f"lockstep [rank {self.launch.rank}]: waited {waited:.0f} s to join the job's "
                f"process group ({self.launch.world_size} ranks, through the store at "
                f"{_where(self.launch)}): rank(s) {missing} have not arrived yet (not started, "
                "still before lockstep.init(), or unable to reach that store)",
                file=sys.stderr,
                flush=True,
            )


def _where(launch: LaunchEnv) -> str:
    return f"{launch.master_addr}:{launch.master_port}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _unreachable(launch: LaunchEnv, timeout: timedelta, error: BaseException) -> str:
    return (
        f"rank {launch.rank} could not reach the job's store at {_where(launch)} within "
        f"{timeout.total_seconds():.0f} s ({TIMEOUT_VARIABLE}): {_first_line(error)}. The "
        "launcher of node 0 hosts it on a port of its own: allow TCP between the training "
        "nodes on the ephemeral ports too (docs/multinode.md)"
    )


def _join_failure(
    launch: LaunchEnv, timeout: timedelta, arrivals: Arrivals | None, error: BaseException
) -> str:
    """'rank 0 waited 15 s to join the job's process group ...: rank(s) [1] never arrived'."""
    missing = arrivals.missing() if arrivals is not None else []
    who = (
        f"rank(s) {missing} never arrived (not started, still before lockstep.init(), or "
        "unable to reach that store: their own logs say which)"
        if missing
        else "every rank arrived, but the group did not form"
    )
    return (
        f"rank {launch.rank} waited {timeout.total_seconds():.0f} s ({TIMEOUT_VARIABLE}) to "
        f"join the job's process group of {launch.world_size} ranks through the store at "
        f"{_where(launch)}: {who} ({_first_line(error)})"
    )
