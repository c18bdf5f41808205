"""Capture and restore a process's random number generators as plain data.

A checkpoint holds one such state per rank, so a resumed run draws the same
dropout masks and augmentations as one that never stopped. The state is made of
tensors, ints, floats and tuples only, so it loads with torch.load(weights_only=True):
python's `random` state is already a tuple of ints; numpy's global state is
turned into a tensor; torch's CPU state is a byte tensor; for CUDA only this
process's current device is captured, so no rank touches another rank's GPU.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]


def _numpy_state() -> dict[str, Any] | None:
    if np is None:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_numpy_state(state: dict[str, Any] | None) -> None:
    if np is None or state is None:
        return
    keys = state["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(
        (state["kind"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"])
    )


def capture() -> dict[str, Any]:
    """This process's generator states: python, numpy (if installed), torch, CUDA (if used)."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(torch.cuda.current_device())
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore(state: dict[str, Any]) -> None:
    """Put back the generator states from `capture()` (CUDA onto the current device)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    _set_numpy_state(state.get("numpy"))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), torch.cuda.current_device())


def restore_rank(
    states: list[Any], saved_size: int, rank: int, world_size: int, source: str
) -> None:
    """Put back this rank's saved state, or warn (rank 0) when the world size changed."""
    if saved_size == world_size:
        restore(states[rank])
    elif rank == 0:
        warnings.warn(
            f"Checkpointer.restore: {source} was saved by {saved_size} rank(s) and this run "
            f"has {world_size}: the model, optimizer and data position are restored "
            "and the samples left in the epoch are re-sharded over the new ranks, but "
            "per-rank random streams restart from the seed this run set; the run will "
            "not repeat an uninterrupted one bit for bit.",
            stacklevel=4,
        )
