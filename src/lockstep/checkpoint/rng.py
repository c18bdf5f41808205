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
