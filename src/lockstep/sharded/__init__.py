"""The sharded engine: ZeRO stages 1, 2 and 3 (FSDP); see docs/sharding.md.

| module | holds |
|---|---|
| `layout.py` | the pure flat layout: offsets, padding, each rank's shard |
| `units.py` | which parameters go together: DDP buckets (1, 2) or wrapped modules (3) |
| `precision.py` | `MixedPrecisionPolicy`: FSDP2's param, reduce and output dtypes |
| `reshard.py` | stage 3's per-unit `reshard_after_forward` |
| `modes.py` | the policy and the reshard rule, resolved and checked on every rank |
| `flat.py` | `FlatParam`: a unit's flat buffer, its shard, the module's views |
| `reduce_scatter.py` | `ShardBucket`; bucket collectives: all-reduce (1), reduce-scatter (2, 3) |
| `sync.py` | `GradSync`: the engine's part of the shared backward driver (`runtime/driver.py`) |
| `gather.py` | stage 3: gather before use, free after, prefetch the next unit |
| `state.py` | full state dicts from shards, and back |
| `optim_state.py` | the optimizer state as the plain model's per-parameter state dict |
| `boxes.py` | pure: a contiguous range of a flattened tensor as rectangles |
| `dcp_pieces.py` | a shard's piece of a tensor as DCP rectangles (`_Checkpointable`), planners |
| `dcp_state.py` | the engine's state in FSDP2's `get_state_dict` shape, and DCP load targets |
| `clip.py` | the global gradient norm over shards |
| `arguments.py` | arguments checked on every rank together |
| `timeline.py` | spans of phases and collectives, for the lanes picture |
| `engine.py` | `ShardedDataParallel`, `FSDP` |
"""

from lockstep.sharded.engine import FSDP, ShardedDataParallel
from lockstep.sharded.precision import MixedPrecisionPolicy

__all__ = ["FSDP", "MixedPrecisionPolicy", "ShardedDataParallel"]
