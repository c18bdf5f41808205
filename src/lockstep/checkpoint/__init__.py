"""Checkpoints: rank 0 writes atomically, every rank restores exactly.

| module | holds |
|---|---|
| `checkpointer.py` | `Checkpointer`: who writes, the barrier, restore on every rank |
| `files.py` | the directory layout, the atomic write, the CRC check, safe loading |
| `state.py` | building the payload, unwrapping wrapped models, key checks |
| `rng.py` | generator states as plain data, per rank |
"""

from lockstep.checkpoint.checkpointer import Checkpointer

__all__ = ["Checkpointer"]
