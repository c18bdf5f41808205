"""Live recovery in the runtime: a survivor keeps its step, a replacement takes its place.

Under `lockstep run --live-recovery` (docs/multinode.md, "Live recovery"):

| who | when | what |
|---|---|---|
| `BackwardDriver` | a bucket launches | `live_steps.py` `keep`: copy its local gradients |
| `BackwardDriver` | a wait failed | `live_steps.py` `recover`: new group, serve, run again |
| `Monitor` (between steps) | its collective failed | `live_between.py`: new group, serve |
| an engine, a Checkpointer | built / restored | register, `declare` in the store |

The registry is per process on purpose: the recovery runs inside autograd's callback,
far from the script's objects, and a process has one default group to re-form.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.live import group as regroup
from lockstep.env import read_seconds, read_timeout, read_variable
from lockstep.runtime import waits
from lockstep.live import opened as live_opened
from lockstep.live import plain as live_plain

ANNOUNCE_WAIT_VARIABLE = "LOCKSTEP_LIVE_ANNOUNCE_S"  # how long a survivor waits for one
DEFAULT_ANNOUNCE_WAIT_S = 30.0
SHARDED_REFUSAL = (
    "lockstep.ShardedDataParallel keeps each rank's shards nowhere else, so no survivor "
    "can hand them over"
)


@dataclass(frozen=True)
class Recovery:
    """Where the survivors recover: what the donor's hand-over depends on.

    Args:
        replaced: the ranks started again.
        within_step: True when the survivors finish an interrupted step with the
            replacement (it resumes at that step); False between two steps (it resumes
            at the next one).
        opened: a survivor is already at the start of the next step or inside it, past
            its opening broadcasts (the buffers', the bucket rebuild's), which nobody
            runs again: survivors between steps and the replacement take what they carry
            (`catch_up`; `live/opened.py`). Always True within a step.
    """

    replaced: tuple[int, ...]
    within_step: bool
    opened: bool = False


class LiveEngine(Protocol):
    """An engine's part: its step count, what a replacement adopts, its group references."""

    steps: int
    module: torch.nn.Module

    def refusal(self) -> str | None: ...
    def state(self, recovery: Recovery) -> dict[str, Any]: ...
    def adopt(self, state: dict[str, Any]) -> None: ...
    def regroup(self, group: dist.ProcessGroup) -> None: ...
    def recovered_before_forward(self) -> None: ...
    def catch_up(self) -> None: ...
    def opening(self) -> contextlib.AbstractContextManager[None]: ...
    def skip_opening(self) -> None: ...


class StateServer(Protocol):
    """The script's state (a Checkpointer's components): sent by a survivor to replacements."""

    def refusal(self) -> str | None: ...
    def serve(self, donor: int, recovery: Recovery) -> None: ...


@dataclass
class _Registry:
    generation: int = field(default_factory=regroup.start_generation)
    engines: list[LiveEngine] = field(default_factory=list)
    server: StateServer | None = None
    refusals: list[str] = field(default_factory=list)  # engines that cannot recover live
    pending: list[dict[str, Any]] | None = None  # engine states received before the engine
    after_step: list[Callable[[], None]] = field(default_factory=list)
    store: dist.Store | None = None


_live = _Registry()


def reset() -> None:
    """A fresh registry, its generation read again (`lockstep.launch.recovery.standby`: a spare
    imported this module before the launcher gave it a rank and a generation)."""
    global _live
    _live = _Registry()


def enabled() -> bool:
    """True under `lockstep run --live-recovery`."""
    return regroup.live_enabled()


def joining() -> bool:
    """True in a replacement that has not yet received its state from a survivor."""
    return regroup.joining()


def store() -> dist.Store:
    """This worker's client of the launcher's worker store (made once)."""
    if _live.store is None:
        _live.store = regroup.worker_store(read_timeout())
    return _live.store


def engines() -> list[LiveEngine]:
    return list(_live.engines)


def register_engine(engine: LiveEngine) -> None:
    """An engine was built; a replacement adopts the state it received already."""
    _live.engines.append(engine)
    if _live.pending is not None and len(_live.pending) == len(_live.engines):
        engine.adopt(_live.pending[-1])
    elif joining() and live_plain.donor_is_plain(store(), donor := donor_of()):
        adopt_received(live_plain.receive(engine.module, donor))  # no restore() will come
        post_joined()
    declare()


def register_refusal(reason: str) -> None:
    """An engine that cannot be recovered live: the launcher restarts the group instead."""
    _live.refusals.append(reason)
    declare()


def hold_refusal(reason: str) -> None:
    """A refusal while a mode lasts (DDP's Join): declared now, until `release_refusal`."""
    if reason not in _live.refusals and enabled():
        _live.refusals.append(reason)
        declare()


def release_refusal(reason: str) -> None:
    if reason in _live.refusals:
        _live.refusals.remove(reason)
        declare()


def server() -> StateServer | None:
    return _live.server


def set_server(server: StateServer) -> None:
    _live.server = server
    declare()


def add_after_step(action: Callable[[], None]) -> None:
    """Run `action` at the end of every synchronised step (the RNG copy)."""
    _live.after_step.append(action)


def after_step() -> None:
    for action in _live.after_step:
        action()


def refusal() -> str | None:
    """Why this rank cannot be recovered live, or None when it can."""
    if _live.refusals:
        return _live.refusals[0]
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return f"live recovery covers gloo only in this version; this job uses {dist.get_backend()}"
    if len(_live.engines) != 1:
        return (
            f"live recovery needs exactly one lockstep.DistributedDataParallel; found "
            f"{len(_live.engines)}"
        )
    server = _live.server  # None: no restore(), the plain hand-over (`live_plain.py`)
    return _live.engines[0].refusal() or (server.refusal() if server is not None else None)


def declare() -> None:
    """Post in the launcher's store whether this rank is recoverable ("" or the reason)."""
    if not enabled() or not dist.is_initialized():
        return
    key = regroup.READY_KEY.format(rank=dist.get_rank())
    live_plain.post_handover(store(), dist.get_rank(), plain=_live.server is None)
    store().set(key, refusal() or "")


def adopt_received(states: list[dict[str, Any]]) -> None:
    """A replacement received the engines' states: adopt them now or when built."""
    _live.pending = states
    regroup.mark_received()
    for engine, state in zip(_live.engines, states, strict=False):
        engine.adopt(state)


def donor_of(replaced: list[int] | None = None) -> int:
    """The lowest surviving rank, which sends the state."""
    if replaced is None:
        _, replaced = regroup.read_announcement(store())
    return min(r for r in range(dist.get_world_size()) if r not in replaced)


def rejoin(error: BaseException) -> list[int]:
    """Join the launcher's next generation; returns the replaced ranks.

    Raises:
        error: this rank is not recoverable, or no generation was announced in time.
    """
    if refusal() is not None:
        raise error
    wait_s = read_seconds(ANNOUNCE_WAIT_VARIABLE, DEFAULT_ANNOUNCE_WAIT_S)
    try:
        new, replaced = regroup.await_generation(store(), _live.generation, wait_s)
    except TimeoutError:
        raise error from None
    group = regroup.reform(store(), new, read_timeout())
    _live.generation = new
    for engine in _live.engines:
        engine.regroup(group)
    return replaced


def hand_over(replaced: list[int], within_step: bool) -> None:
    """Survivors, after `rejoin`: the donor sends the state; then this rank has joined.

    Args:
        replaced: what `rejoin` returned.
        within_step: the survivors run the interrupted step again (`Recovery`).
    """
    steps = _live.engines[0].steps if _live.engines else 0
    wait_s = read_seconds(ANNOUNCE_WAIT_VARIABLE, DEFAULT_ANNOUNCE_WAIT_S)
    opened = live_opened.opened(store(), _live.generation, steps, replaced, within_step, wait_s)
    recovery = Recovery(tuple(replaced), within_step, opened)
    server = _live.server or live_plain.PlainServer(_live.engines)
    server.serve(donor_of(replaced), recovery)
    if recovery.opened and not within_step:
        for engine in _live.engines:
            engine.catch_up()
        print(
            f"lockstep [rank {dist.get_rank()}]: live recovery: a peer is already past the "
            "start of the next step: its opening broadcasts are taken from rank 0's posts",
            file=sys.stderr,
            flush=True,
        )
    post_joined()


def round_key(name: str) -> str:
    """A store key of this rendezvous round (the launcher's store outlives a restart)."""
    return f"lockstep/live/round{read_variable('TORCHELASTIC_RESTART_COUNT') or '0'}/{name}"


def generation() -> int:
    return _live.generation


def post_joined() -> None:
    """Tell the launcher this rank is in the new generation with its state."""
    key = regroup.JOINED_KEY.format(generation=_live.generation, rank=dist.get_rank())
    store().set(key, "1")


def announced() -> None:
    """A wait's check: a newer generation was announced, so a rank was lost: stop waiting.

    On several nodes, a rank whose neighbours in the collective survived sees no error."""
    generation, replaced = regroup.read_announcement(store())
    if generation > _live.generation:
        raise waits.Interrupted(
            f"generation {generation} was announced while this rank waited (rank(s) "
            f"{replaced} replaced)"
        )
