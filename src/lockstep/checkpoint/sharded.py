"""Checkpoints of a `ShardedDataParallel` model: gathered on save, resliced on restore.

A sharded model's weights and optimizer state are spread over the ranks, so
before rank 0 writes, every rank takes part in gathering them
(`gather_for_save`): the file then holds the plain module's state dict and the
per-parameter optimizer state a plain optimizer would have. On restore each
rank reads the file and keeps its own slice (`load_sharded`), so a checkpoint
resumes exactly at the same world size and reshards at another (or another stage).
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import CheckpointError
from lockstep.sharded.engine import ShardedDataParallel


class Gathered:
    """A state dict gathered in advance, standing in for its model or optimizer."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def gather_for_save(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """On every rank: for a sharded model, the gathered model and optimizer states.

    Returns:
        (model, optimizer) unchanged for any other model; `Gathered` stand-ins otherwise.
    """
    if not isinstance(model, ShardedDataParallel):
        return model, optimizer
    saved_model = Gathered(model.state_dict())
    if optimizer is None:
        return saved_model, None
    return saved_model, Gathered(model.optimizer_state_dict(optimizer))


def load_sharded(
    model: ShardedDataParallel, optimizer: Any, payload: dict[str, Any], source: str
) -> None:
    """Load this rank's slices of a checkpoint into a sharded model and its optimizer.

    Raises:
        CheckpointError: the keys differ from the model's, or the optimizer state does
            not fit (or is missing although an optimizer is given).
    """
    saved = {k.removeprefix("module."): v for k, v in payload["model"].items()}
    expected = model.state_dict_keys()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit this model: keys missing from the checkpoint "
            f"{missing[:6]}, keys the model does not have {unexpected[:6]}. Expected a "
            "checkpoint of the same architecture."
        )
    model.load_state_dict(saved)
    if optimizer is None:
        return
    state = payload.get("optimizer")
    if state is None or not state.get("sharded"):
        raise CheckpointError(
            f"{source} holds no sharded optimizer state; save it with the same "
            "ShardedDataParallel model and optimizer=, or restore without optimizer="
        )
    try:
        model.load_optimizer_state_dict(optimizer, state)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as error:
        raise CheckpointError(f"the optimizer state in {source} does not fit: {error}") from None
