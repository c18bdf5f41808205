"""`Checkpointer.save` under live recovery: a rank lost inside a save, the save done once.

A rank can die inside `save()`: rank 0 between its temporary file and the rename, or
another rank before the barrier that waits for rank 0. The survivors' save then fails
in a collective (the random-state gather, the barrier, rank 0's answer); `save` here
joins the next generation as a failed backward would (`live/registry.py`) and hands
the state over. Whether the step's checkpoint was committed (`latest` names it)
decides the rest: committed, every rank returns; not yet, the survivors and the
replacement (inside its `restore()`) run the save again together, and the new rank 0
writes it; its first act is to remove the dead writer's temporary file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from lockstep.errors import LockstepError
from lockstep.live import registry as live


@runtime_checkable
class SaveServer(Protocol):
    """A survivor's hand-over that can tell the replacement to run a save again."""

    interrupted_save: tuple[int, Any] | None  # (step, extra) or None


def _lost_peer(error: BaseException) -> bool:
    """A collective that failed (not an error lockstep raised on purpose about a save)."""
    cause = error if not isinstance(error, LockstepError) else error.__cause__
    return isinstance(cause, RuntimeError) and not isinstance(cause, LockstepError)


def save(checkpointer: Any, step: int, components: dict[str, Any], extra: Any) -> Path:
    """`checkpointer._save`, finished with the next generation when a rank is lost in it."""
    try:
        return checkpointer._save(step, components, extra)
    except RuntimeError as error:
        server = live.server()
        if not _lost_peer(error) or not isinstance(server, SaveServer):
            raise  # no restore() to run the save again in: the whole-group restart
        start = time.monotonic()
        replaced = live.rejoin(error)
        committed = checkpointer.files.committed_step()[0] == step
        server.interrupted_save = None if committed else (step, extra)
        try:
            live.hand_over(replaced, within_step=False)
        finally:
            server.interrupted_save = None
        print(
            f"lockstep [rank {dist.get_rank()}]: live recovery: generation {live.generation()}, "
            f"rank(s) {replaced} replaced inside the save of step {step}, which "
            f"{'was committed already' if committed else 'runs again'}; "
            f"{time.monotonic() - start:.2f} s standing still",
            file=sys.stderr,
            flush=True,
        )
        if committed:
            return checkpointer.files.path_for(step)
        return checkpointer._save(step, components, extra)


def finish(checkpointer: Any, model: Any, components: dict[str, Any], interrupted: Any) -> None:
    """The replacement's part of a save its peers are running again (in `restore()`)."""
    if interrupted is None:
        return
    step, extra = interrupted
    checkpointer._save(int(step), {"model": model, **components}, extra)
