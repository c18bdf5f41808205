"""Test tooling that ships with lockstep, so users can test their own distributed code.

| module | holds |
|---|---|
| `ranks.py` | `run_ranks`: spawn gloo ranks with short timeouts, rank-tagged failures |
| `torch_features.py` | which torch DDP arguments the installed torch takes (version skips) |
| `netns.py` | `two_hosts`: two network namespaces joined by a veth pair (root only) |
"""

from lockstep.testing.ranks import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
