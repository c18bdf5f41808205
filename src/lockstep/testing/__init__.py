"""Test tooling that ships with lockstep, so users can test their own distributed code.

| module | holds |
|---|---|
| `ranks.py` | `run_ranks`: spawn gloo ranks with short timeouts, rank-tagged failures |
| `torch_features.py` | which torch DDP arguments the installed torch takes (version skips) |
| `netns.py` | `two_hosts`: two network namespaces joined by a veth pair (root only) |
| `mesh.py` | `device_mesh`: a mesh of the model's device type for torch's `fully_shard` |
| `syncs.py` | `count_cuda_syncs`, `count_host_reads`: a step's host synchronisations |
"""

from lockstep.testing.ranks import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
