"""Checkpoints: rank 0 writes atomically, every rank restores exactly.

| module | holds |
|---|---|
| `checkpointer.py` | `Checkpointer`: who writes, the barrier, restore on every rank |
| `files.py` | the directory layout, the atomic write, the CRC check, safe loading |
| `state.py` | building the payload, unwrapping wrapped models, key checks |
| `rng.py` | generator states as plain data, per rank |
| `coordination.py` | the ranks' timed barrier, rank 0's answer, errors raised on every rank |
| `dcp.py` | model and optimizer through torch's DCP, in FSDP2's keys (`format="dcp"`) |
| `dcp_checkpointer.py` | `format="dcp"`: each rank writes its part, rank 0 commits |
| `dcp_files.py` | DCP folders: commit by rename, `latest`, the manifest's CRC32s, file checks |
"""

from lockstep.checkpoint.checkpointer import Checkpointer

__all__ = ["Checkpointer"]
