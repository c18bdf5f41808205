"""`Checkpointer.save` under live recovery: a rank lost inside a save, the save done once.

A rank can die inside `save()`: rank 0 between its temporary file and the rename, or
another rank before the barrier that waits for rank 0. The survivors' save then fails
in a collective (the random-state gather, the barrier, rank 0's answer); the save is
a recovery point (`runtime/recovery.py`, "inside a save"): the survivors join the
next generation and hand the state over. Whether the step's checkpoint was committed
(`latest` names it) decides the rest: committed, every rank returns; not yet, the
survivors and the replacement (inside its `restore()`) run the save again together,
and the new rank 0 writes it; its first act is to remove the dead writer's temporary
file.
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import LockstepError


def lost_peer(error: BaseException) -> bool:
    """A collective that failed (not an error lockstep raised on purpose about a save)."""
    cause = error if not isinstance(error, LockstepError) else error.__cause__
    return isinstance(cause, RuntimeError) and not isinstance(cause, LockstepError)


def committed(save: Any) -> bool:
    """Whether `save` (a `SaveInProgress`) reached `latest` before the loss."""
    return save.checkpointer.files.committed_step()[0] == save.step


def interrupted(save: Any) -> tuple[int, Any]:
    """What the replacement needs to run `save` again with its peers: (step, extra)."""
    return save.step, save.extra


def finish(checkpointer: Any, model: Any, components: dict[str, Any], pending: Any) -> None:
    """The replacement's part of a save its peers are running again (in `restore()`)."""
    if pending is None:
        return
    step, extra = pending
    checkpointer.write_checkpoint(int(step), {"model": model, **components}, extra)
