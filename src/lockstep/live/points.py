"""The wing behind every recovery point: `LiveRecoverer` (`runtime/recovery.py`'s `Recoverer`).

At a point the survivors join the launcher's next generation (`registry.rejoin`),
the donor hands the state over (`registry.hand_over`), and the point ends as its
`Where` says:

- the rebuild's broadcast: rank 0 posts its order first; after a loss, the order
  comes from the post, and the forward's buffer broadcast and Join's notices are
  taken too;
- the buffer broadcast (rank 0 posts its buffers after each synchronised forward):
  after a loss, rank 0's posted buffers; Join's notices taken;
- the data's agreement: each rank posts its statement first; after a loss, rank 0's
  (or the donor's) statement, settled before the hand-over;
- between steps: nothing more, the caller goes on without the result;
- a save: done if it was committed, else run again (the replacement too).

A point that peers ran before this rank was recovered is not run (`entering`): its
value was taken at the recovery (`registry.take`).
"""

from __future__ import annotations

import time
from typing import Any

from lockstep.errors import LockstepError
from lockstep.live import agreement, lines, rebuild, registry, save
from lockstep.live.checkpoint import LiveState
from lockstep.live.checkpoint import receive as receive_state
from lockstep.live.checkpoint import register as register_state
from lockstep.live.checkpoint import saved as saved_step
from lockstep.runtime.recovery import Outcome, Point, Position, Where


class LiveRecoverer:
    """Installed at import under `lockstep run --live-recovery` (`lockstep.live.install`)."""

    def entering(self, point: Point, step: int, value: Any) -> Outcome | None:
        was, taken = registry.taken(point)
        if was:
            return Outcome(False, taken)
        if point is Point.REBUILD:
            rebuild.post(value)
        elif point is Point.AGREEMENT:
            agreement.post(value[0])
        return None

    def passed(self, point: Point, step: int) -> None:
        if point is Point.BUFFERS:
            for engine in registry.engines():
                engine.broadcast_done()

    def skips(self, point: Point, consume: bool) -> bool:
        return registry.taken(point, consume)[0]

    def lost(self, point: Point, step: int, error: BaseException, value: Any) -> Outcome:
        """Recover a loss met at `point`, or raise.

        Raises:
            error: not a lost rank (an error lockstep raised on purpose), or this rank
                cannot be recovered live (then the launcher restarts the group).
        """
        lost_peer = save.lost_peer(error) if point is Point.SAVE else True
        if not lost_peer or (point is not Point.SAVE and isinstance(error, LockstepError)):
            raise error
        if point is Point.SAVE and not isinstance(registry.server(), LiveState):
            raise error  # no restore() to run the save again in: the whole-group restart
        start = time.monotonic()
        replaced = registry.rejoin(error)
        at = Position(point, step)
        if point is Point.AGREEMENT:
            outcome, then = self._agreement(replaced, value)
            registry.hand_over(replaced, at)
        elif point is Point.SAVE:
            outcome, then, pending = _save(value)
            registry.hand_over(replaced, at, save=pending)
        else:
            registry.hand_over(replaced, at)
            outcome, then = _opening(point) if point.where is Where.OPENING else _between()
        where = f"during {point.describe(step)}, {point.where.value}"
        if point is Point.SAVE:
            where = f"inside the save of step {step}"
        lines.recovered(registry.generation(), replaced, where, then, time.monotonic() - start)
        return outcome

    def _agreement(self, replaced: list[int], value: Any) -> tuple[Outcome, str]:
        """Before the hand-over: take rank 0's (or the donor's) statement and settle it."""
        _, settle = value
        rank, statement = agreement.taken(replaced)
        if settle is not None:
            settle(statement)
        for engine in registry.engines():
            engine.recovered_before_forward()
        return Outcome(False, [statement]), f"took rank {rank}'s statement"

    def replacing(self) -> bool:
        return registry.joining()

    def refuse(self, reason: str, held: bool) -> None:
        registry.refuse(reason, held)

    def release(self, reason: str) -> None:
        registry.release(reason)

    def restore(self, checkpointer: Any, model: Any, components: dict[str, Any]) -> int | None:
        return receive_state(checkpointer, model, components)

    def restored(
        self, checkpointer: Any, model: Any, components: dict[str, Any], step: int | None
    ) -> None:
        register_state(checkpointer, model, components, step)

    def saving(self, step: int) -> None:
        saved_step(step)


def _opening(point: Point) -> tuple[Outcome, str]:
    """Recovered at a step's start: what the collective carries, from rank 0's post."""
    value = None
    for engine in registry.engines():
        value = engine.met_loss(point)
    return Outcome(False, value), "its value taken from rank 0's post"


def _between() -> tuple[Outcome, str]:
    return Outcome(False), "the replacement resumes at the next step"


def _save(value: Any) -> tuple[Outcome, str, Any]:
    """A save met the loss: done if it was committed, else every rank runs it again."""
    if save.committed(value):
        path = value.checkpointer.files.path_for(value.step)
        return Outcome(True, path), "the save was committed already", None
    return Outcome(False), "the save runs again", save.interrupted(value)
