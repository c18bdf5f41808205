"""Recovery points: the one call a host makes around a collective that can meet a lost rank.

A collective fails when a rank of the group dies. Without live recovery that failure
is raised where it happens, as ever: `run` is a plain wait. Under `lockstep run
--live-recovery` the wing installed at import (`lockstep.live`) replaces the lost
rank while this process keeps its state, and the host goes on as follows:

- *Inside a step* (its buckets, fingerprint, end-of-step checks): the driver's slot
  (`StepRecovery`) runs the step's collectives again with the replacement.
- *At a step's start* (`Where.OPENING`: the bucket rebuild's broadcast, the buffer
  broadcast, the data's agreement, Join's notices): recovered as inside the step they
  open, and nobody runs them again: `run` returns what the collective carries
  (`Outcome.value`), taken from a peer's post.
- *Between steps* (the Monitor's loss average, its straggler exchange, its closing
  barrier): recovered as after the last finished step; the host goes on without
  the result.
- *Inside a save*: recovered as after the last finished step; the save runs again
  with the replacement (`run_again`) unless it was committed.

The seam is this module and the driver's slot: no host imports the wing, and the
wing reaches the hosts only through their public methods. `position()` says where
this process stands (the point and its step), the one answer to "where am I" that
a hand-over needs; the stall watch reads the same from the progress record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from lockstep.runtime import progress, waits
from lockstep.runtime.handles import WorkHandle

T = TypeVar("T")


class Where(enum.Enum):
    """Where a step stands when a collective meets a lost rank."""

    INSIDE = "inside the step"
    OPENING = "at the start of the step"
    BETWEEN = "between steps"
    SAVING = "inside a save"


class Point(enum.Enum):
    """A collective outside a step's backward that can meet a lost rank."""

    REBUILD = "the bucket rebuild's broadcast"
    BUFFERS = "the buffer broadcast"
    AGREEMENT = "the data's agreement before the first batch"
    JOIN_NOTICES = "Join's notices"
    LOSS_MEAN = "the Monitor's loss average"
    STRAGGLERS = "the straggler report's exchange"
    CLOSING = "the Monitor's closing barrier"
    SAVE = "a checkpoint's save"

    @property
    def where(self) -> Where:
        return _WHERE[self]

    def describe(self, step: int) -> str:
        """'the buffer broadcast of step 3' and the like (no step: before the first)."""
        return f"{self.value} of step {step}" if step > 0 else self.value


_WHERE = {
    Point.REBUILD: Where.OPENING,
    Point.BUFFERS: Where.OPENING,
    Point.AGREEMENT: Where.OPENING,
    Point.JOIN_NOTICES: Where.OPENING,
    Point.LOSS_MEAN: Where.BETWEEN,
    Point.STRAGGLERS: Where.BETWEEN,
    Point.CLOSING: Where.BETWEEN,
    Point.SAVE: Where.SAVING,
}
_PHASE = {Where.OPENING: progress.Phase.OPENING, Where.BETWEEN: progress.Phase.BETWEEN}


@dataclass(frozen=True)
class Position:
    """Where this process stands: in `point` (None: no recovery point) of `step`."""

    point: Point | None
    step: int

    @property
    def where(self) -> Where:
        return Where.INSIDE if self.point is None else self.point.where


@dataclass(frozen=True)
class Outcome:
    """How a recovery point ended.

    Attributes:
        ran: the collective completed here; False: a rank was lost in it and recovered
            live, or peers had run it before this rank was recovered.
        value: when it did not run, what it carries (rank 0's buffers, the rebuilt
            order, the agreed statement), taken from a peer's post; None when nothing
            is carried or the host keeps its own. For a save: its file, if committed.
    """

    ran: bool
    value: Any = None


RAN = Outcome(True)


class Recoverer(Protocol):
    """What the wing provides; every method is called only while it is installed."""

    def entering(self, point: Point, step: int, value: Any) -> Outcome | None:
        """Before the collective starts: post what a peer may need; an Outcome means it
        must not run (peers ran it before this rank was recovered)."""
        ...

    def passed(self, point: Point, step: int) -> None:
        """The collective completed on this rank."""
        ...

    def skips(self, point: Point, consume: bool) -> bool:
        """Whether peers ran `point` before this rank was recovered (`consume`: forget it)."""
        ...

    def lost(self, point: Point, step: int, error: BaseException, value: Any) -> Outcome:
        """A rank was lost in it: recover, or raise (`error`, or a fallback's reason)."""
        ...

    def replacing(self) -> bool:
        """This process replaces a lost rank and receives its state from a survivor."""
        ...

    def refuse(self, reason: str, held: bool) -> None:
        """This rank cannot be recovered live (`held`: until `release(reason)`)."""
        ...

    def release(self, reason: str) -> None: ...

    def restore(self, checkpointer: Any, model: Any, components: dict[str, Any]) -> int | None:
        """A replacement's `Checkpointer.restore`: the state from a survivor."""
        ...

    def restored(
        self, checkpointer: Any, model: Any, components: dict[str, Any], step: int | None
    ) -> None:
        """A survivor-to-be restored `step` (None: from scratch) into `components`."""
        ...

    def saving(self, step: int) -> None:
        """`Checkpointer.save(step)` was called."""
        ...


_recoverer: Recoverer | None = None
_position = Position(None, 0)
_recoveries = 0


def install(recoverer: Recoverer | None) -> None:
    """Put `recoverer` (the live wing; None: none) behind every recovery point."""
    global _recoverer
    _recoverer = recoverer


def installed() -> Recoverer | None:
    return _recoverer


def position() -> Position:
    """The recovery point this process is in, and its step."""
    return _position


def recoveries() -> int:
    """Live recoveries this process took part in at recovery points, and points it
    skipped because peers met a loss there (the Monitor's check that a report's
    exchange was not cut short)."""
    return _recoveries


Works = dist.Work | Sequence[dist.Work] | None


def run(
    point: Point,
    step: int,
    launch: Callable[[], Works],
    value: Any = None,
    group: dist.ProcessGroup | None = None,
) -> Outcome:
    """Launch a collective and wait for it; a plain wait when live recovery is off.

    The wait is watched as the buckets' are (`waits.wait`: the stall inspector, and the
    progress record in the point's phase, so the launcher's stall watch counts it).

    Args:
        point: which collective it is (its `Where` comes with it).
        step: the synchronised step it belongs to (opens, or follows; 0: before the first).
        launch: starts it; returns its work(s) (`async_op=True`).
        value: what the wing may need of this rank at this point (the order this rank
            broadcasts, the sampler that agrees): posted ahead, for a peer to take.
        group: the group it runs over (None: the default group), for the stall inspector.

    Returns:
        `RAN`, or how a loss met in it was recovered (`Outcome`).

    Raises:
        RuntimeError: the collective failed and this rank cannot be recovered live.
    """
    global _recoveries
    with _at(point, step):
        if _recoverer is None:
            _wait(point, step, launch(), group)
            return RAN
        taken = _recoverer.entering(point, step, value)
        if taken is not None:  # peers met a loss here before this rank came: counted too
            _recoveries += 1
            return taken
        try:
            _wait(point, step, launch(), group)
        except RuntimeError as error:
            return _lost(point, step, error, value)
        _recoverer.passed(point, step)
        return RAN


def _wait(point: Point, step: int, works: Works, group: dist.ProcessGroup | None) -> None:
    phase = _PHASE.get(point.where, progress.Phase.WAITING)
    for work in _works(works):
        waits.wait(WorkHandle(work), point.value, step, -1, group, phase)


def run_again(point: Point, step: int, body: Callable[[], T], value: Any = None) -> T:
    """Run `body`, a region of several collectives (a save), again after a loss met in it,
    unless the recovery says it is done (`Outcome.ran`: its value is returned)."""
    if _recoverer is None:
        return body()
    with _at(point, step):
        while True:
            try:
                return body()
            except RuntimeError as error:
                outcome = _lost(point, step, error, value)
                if outcome.ran:
                    return outcome.value


def skips(point: Point, consume: bool = True) -> bool:
    """Whether peers ran `point` before this rank was recovered, so it must not run it now:
    for collectives the host does not wait on itself (Join's notices, sent at two moments
    of a forward: the first asks without `consume`)."""
    return _recoverer is not None and _recoverer.skips(point, consume)


def _lost(point: Point, step: int, error: RuntimeError, value: Any) -> Outcome:
    global _recoveries
    assert _recoverer is not None
    outcome = _recoverer.lost(point, step, error, value)
    _recoveries += 1
    return outcome


@contextmanager
def _at(point: Point, step: int) -> Iterator[None]:
    """The block runs at `point` of `step` (the position a hand-over reads)."""
    global _position
    before, _position = _position, Position(point, step)
    try:
        yield
    finally:
        _position = before


def _works(works: Works) -> list[dist.Work]:
    if works is None:
        return []
    if isinstance(works, dist.Work):
        return [works]
    return list(works)


# ---------------------------------------------------------------- state hooks
def replacing() -> bool:
    """This process replaces a lost rank: its state comes from a survivor, so it runs no
    collective of its own before then (the wrap's broadcast, its checks)."""
    return _recoverer is not None and _recoverer.replacing()


def refuse(reason: str) -> None:
    """This rank cannot be recovered live (the launcher restarts the group instead)."""
    if _recoverer is not None:
        _recoverer.refuse(reason, held=False)


def hold_refusal(reason: str) -> None:
    """A refusal while a mode lasts (DDP's Join), until `release_refusal(reason)`."""
    if _recoverer is not None:
        _recoverer.refuse(reason, held=True)


def release_refusal(reason: str) -> None:
    if _recoverer is not None:
        _recoverer.release(reason)


def saving(step: int) -> None:
    """`Checkpointer.save(step)` was called (the wing learns the script's numbering)."""
    if _recoverer is not None:
        _recoverer.saving(step)


def restored(checkpointer: Any, model: Any, components: dict[str, Any], step: int | None) -> None:
    """`Checkpointer.restore` loaded `step` (None: nothing) into `components`."""
    if _recoverer is not None:
        _recoverer.restored(checkpointer, model, components, step)


def restore_from_peer(checkpointer: Any, model: Any, components: dict[str, Any]) -> int | None:
    """A replacement's `Checkpointer.restore`: the state a survivor sends (call only when
    `replacing()`)."""
    assert _recoverer is not None
    return _recoverer.restore(checkpointer, model, components)
