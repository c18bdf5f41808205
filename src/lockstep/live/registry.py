"""What live recovery knows of this process: its engines, its state server, its generation.

Under `lockstep run --live-recovery` (docs/multinode.md):

- an engine is wrapped: `lockstep.live` attaches its part, which registers here
  (`register_engine`) and declares in the store whether this rank is recoverable;
- `Checkpointer.restore()`: its components become what a hand-over sends (`set_server`);
- a recovery point meets a lost rank: `rejoin` the next generation, then `hand_over`
  (the donor sends the state).

The registry is per process on purpose: a recovery runs inside autograd's callback
or a collective's wait, far from the script's objects, and a process has one default
group to re-form. The openings a recovery pre-empted (`taken`) are part of where the
process stands: a rank recovered at a step's start does not run that step's opening
collectives again, it takes what they carry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.env import read_seconds, read_timeout, read_variable
from lockstep.live import group, keys, lines, plain, sealed, standing
from lockstep.runtime import waits
from lockstep.runtime.recovery import Point, Position, Where

ANNOUNCE_WAIT_VARIABLE = "LOCKSTEP_LIVE_ANNOUNCE_S"  # how long a survivor waits for one
DEFAULT_ANNOUNCE_WAIT_S = 30.0
SHARDED_REFUSAL = (
    "lockstep.ShardedDataParallel keeps each rank's shards nowhere else, so no survivor "
    "can hand them over"
)


@dataclass(frozen=True)
class Recovery:
    """One recovery as the donor's hand-over sees it.

    Args:
        replaced: the ranks started again.
        position: where the donor met the loss (a recovery point, or inside a step).
        opened: a survivor is already at the start of the next step or inside it, past
            its opening broadcasts, which nobody runs again (`live/standing.py`).
        ahead: the survivors that had finished the step this rank was still in (its
            last collective): it takes that step's outcome from them and is recovered
            as after it (empty when none did; never in the donor).
        between: the collectives between steps those ahead met the loss in, which this
            rank skips too once its step ends.
    """

    replaced: tuple[int, ...]
    position: Position
    opened: bool = False
    ahead: tuple[int, ...] = ()
    between: frozenset[Point] = frozenset()

    @property
    def within_step(self) -> bool:
        """The survivors finish a step with the replacement (it resumes at that step)."""
        return not self.ahead and self.position.where in (Where.INSIDE, Where.OPENING)

    @property
    def point(self) -> Point | None:
        return self.position.point


class LiveEngine(Protocol):
    """An engine's part: its step count, what a replacement adopts, its group references."""

    steps: int
    module: torch.nn.Module

    def refusal(self) -> str | None: ...
    def state(self, recovery: Recovery) -> dict[str, Any]: ...
    def adopt(self, state: dict[str, Any]) -> None: ...
    def regroup(self, group: dist.ProcessGroup) -> None: ...
    def recovered_before_forward(self) -> None: ...
    def skip_opening(self, rebuilt: bool) -> None: ...
    def broadcast_done(self) -> None: ...
    def met_loss(self, point: Point) -> Any: ...


class StateServer(Protocol):
    """The script's state (a Checkpointer's components): sent by a survivor to replacements."""

    def refusal(self) -> str | None: ...
    def serve(self, donor: int, recovery: Recovery, save: Any) -> None: ...


@dataclass
class _Registry:
    generation: int = field(default_factory=group.start_generation)
    engines: list[LiveEngine] = field(default_factory=list)
    server: StateServer | None = None
    refusals: list[str] = field(default_factory=list)  # reasons this rank is not recoverable
    pending: list[dict[str, Any]] | None = None  # engine states received before the engine
    after_step: list[Callable[[], None]] = field(default_factory=list)
    in_step: list[Callable[[], None]] = field(default_factory=list)
    taken: dict[Point, Any] = field(default_factory=dict)  # openings pre-empted: their values
    store: dist.Store | None = None


_live = _Registry()


def reset() -> None:
    """A fresh registry, its generation read again (`lockstep.launch.recovery.standby`: a
    spare imported this module before the launcher gave it a rank and a generation)."""
    global _live
    _live = _Registry()


def enabled() -> bool:
    """True under `lockstep run --live-recovery`."""
    return group.live_enabled()


def joining() -> bool:
    """True in a replacement that has not yet received its state from a survivor."""
    return group.joining()


def store() -> dist.Store:
    """This worker's client of the launcher's worker store (made once)."""
    if _live.store is None:
        _live.store = group.worker_store(read_timeout())
    return _live.store


def engines() -> list[LiveEngine]:
    return list(_live.engines)


def steps() -> int:
    """Synchronised steps the engine finished (0 before one is registered)."""
    return _live.engines[0].steps if _live.engines else 0


def register_engine(engine: LiveEngine) -> None:
    """An engine was built; a replacement adopts the state it received already."""
    _live.engines.append(engine)
    if _live.pending is not None and len(_live.pending) == len(_live.engines):
        engine.adopt(_live.pending[-1])
    elif joining() and plain.donor_is_plain(store(), sender := donor()):
        adopt_received(plain.receive(engine.module, sender))  # no restore() will come
        post_joined()
    declare()


def refuse(reason: str, held: bool = False) -> None:
    """This rank cannot be recovered live (`held`: until `release(reason)`, as DDP's Join)."""
    if held and (reason in _live.refusals or not enabled()):
        return
    _live.refusals.append(reason)
    declare()


def release(reason: str) -> None:
    if reason in _live.refusals:
        _live.refusals.remove(reason)
        declare()


def server() -> StateServer | None:
    return _live.server


def set_server(server: StateServer) -> None:
    _live.server = server
    declare()


def add_after_step(action: Callable[[], None]) -> None:
    """Run `action` at the end of every synchronised step (the random state's copy)."""
    _live.after_step.append(action)


def after_step() -> None:
    for action in _live.after_step:
        action()


def add_in_step(action: Callable[[], None]) -> None:
    """Run `action` in every synchronised step as its first bucket launches: before the
    step's last collective, so a rank lost after that collective has posted already
    (the random state's post)."""
    _live.in_step.append(action)


def in_step() -> None:
    for action in _live.in_step:
        action()


def take(point: Point, value: Any) -> None:
    """Peers ran `point` (an opening of the coming step) already: this rank takes `value`
    (None: keeps what it holds) instead of running it."""
    _live.taken[point] = value


def taken(point: Point, consume: bool = True) -> tuple[bool, Any]:
    """(whether `point` was taken, its value); `consume` forgets it."""
    if point not in _live.taken:
        return False, None
    value = _live.taken.pop(point) if consume else _live.taken[point]
    return True, value


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
    server = _live.server  # None: no restore(), the plain hand-over (`live/plain.py`)
    return _live.engines[0].refusal() or (server.refusal() if server is not None else None)


def declare() -> None:
    """Post in the launcher's store whether this rank is recoverable ("" or the reason)."""
    if not enabled() or not dist.is_initialized():
        return
    rank = dist.get_rank()
    plain.post_handover(store(), rank, plain=_live.server is None)
    sealed.put(store(), keys.READY.format(rank=rank), refusal() or "")


def adopt_received(states: list[dict[str, Any]]) -> None:
    """A replacement received the engines' states: adopt them now or when built."""
    _live.pending = states
    group.mark_received()
    for engine, state in zip(_live.engines, states, strict=False):
        engine.adopt(state)


def donor_of(replaced: list[int]) -> int:
    """The lowest surviving rank: it posts for the others where rank 0 is lost, and it
    is the donor unless a survivor finished a step the others had not (`donor`)."""
    return min(r for r in range(dist.get_world_size()) if r not in replaced)


def donor() -> int:
    """A replacement: the survivor that sends it the state, read from where the survivors
    stand (the lowest rank of those furthest ahead, `live/standing.py`)."""
    generation, replaced = group.read_announcement(store())
    if generation != _live.generation:
        raise lines.fallback(
            f"rank {dist.get_rank()}, started for generation {_live.generation}, found "
            f"generation {generation} announced in the worker store (overwritten)"
        )
    wait_s = read_seconds(ANNOUNCE_WAIT_VARIABLE, DEFAULT_ANNOUNCE_WAIT_S)
    stands = standing.read(store(), _live.generation, _survivors(replaced), wait_s)
    return standing.donor(stands)


def _survivors(replaced: list[int]) -> list[int]:
    return [r for r in range(dist.get_world_size()) if r not in replaced]


def rejoin(error: BaseException) -> list[int]:
    """Join the launcher's next generation; returns the replaced ranks.

    Raises:
        error: this rank is not recoverable, or no generation was announced in time.
    """
    if refusal() is not None:
        raise error
    wait_s = read_seconds(ANNOUNCE_WAIT_VARIABLE, DEFAULT_ANNOUNCE_WAIT_S)
    try:
        new, replaced = group.await_generation(store(), _live.generation, wait_s)
    except TimeoutError:
        raise error from None
    regrouped = group.reform(store(), new, read_timeout())
    _live.generation = new
    for engine in _live.engines:
        engine.regroup(regrouped)
    return replaced


def hand_over(
    replaced: list[int], position: Position, save: Any = None, reduced: bool = False
) -> Recovery:
    """Survivors, after `rejoin`: the donor sends the state; then this rank has joined.

    Args:
        replaced: what `rejoin` returned.
        position: where this rank met the loss.
        save: an interrupted save the replacement runs again (`live/save.py`).
        reduced: inside a step, its buckets are reduced (only its fingerprint was out).

    Raises:
        LockstepError: the survivors stand too far apart to finish together (every
            survivor raises the same reason, and posts it for the launcher).
    """
    wait_s = read_seconds(ANNOUNCE_WAIT_VARIABLE, DEFAULT_ANNOUNCE_WAIT_S)
    within = Recovery(tuple(replaced), position).within_step
    point = position.point.name if position.point is not None else ""
    mine = standing.Stand(dist.get_rank(), steps(), within, point, reduced)
    stands = standing.survey(store(), _live.generation, mine, _survivors(replaced), wait_s)
    reason = standing.lagging(stands)
    if reason is not None:
        refuse(reason)
        raise lines.fallback(reason)
    ahead = tuple(standing.ahead(stands, mine))
    after = standing.furthest(stands)  # the steps this rank counts once recovered
    at = standing.opened(stands, after, within and not ahead)
    between = frozenset(standing.taken_between(stands)) if ahead else frozenset()
    recovery = Recovery(tuple(replaced), position, at, ahead, between)
    server = _live.server or plain.PlainServer(_live.engines)
    server.serve(standing.donor(stands), recovery, save)
    if recovery.opened and not recovery.within_step and not ahead:
        _skip_openings()
    post_joined()
    return recovery


def caught_up(recovery: Recovery) -> None:
    """A survivor that took its step's outcome from those ahead (`Recovery.ahead`), at
    that step's end: it skips what they skipped after the step."""
    for point in recovery.between:
        take(point, None)
    if recovery.opened:
        _skip_openings()


def _skip_openings() -> None:
    for engine in _live.engines:
        engine.skip_opening(rebuilt=False)
    lines.say(
        "a peer is already past the start of the next step: its opening broadcasts are "
        "taken from rank 0's posts"
    )


def generation() -> int:
    return _live.generation


def post_joined() -> None:
    """Tell the launcher this rank is in the new generation with its state."""
    key = keys.JOINED.format(generation=_live.generation, rank=dist.get_rank())
    sealed.put(store(), key, 1)


def post_ended() -> None:
    """This rank's script ended well (its bootstrap says so): a launcher that loses a peer
    after this replaces nobody, since no generation can form with this rank any more
    (`launch/recovery/finished.py`). The launcher of this node also sees the exit."""
    if not enabled():
        return
    try:
        sealed.put(store(), keys.ENDED.format(rank=read_variable("RANK") or "0"), 1)
        store().add(keys.ENDED_COUNT, 1)
    except RuntimeError:  # the store is gone: the job is ending anyway
        return


def announced() -> None:
    """A wait's check: a newer generation was announced, so a rank was lost: stop waiting.

    On several nodes, a rank whose neighbours in the collective survived sees no error."""
    generation, replaced = group.read_announcement(store())
    if generation > _live.generation:
        raise waits.Interrupted(
            f"generation {generation} was announced while this rank waited (rank(s) "
            f"{replaced} replaced)"
        )
