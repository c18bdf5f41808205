"""torch APIs renamed between the torch versions lockstep runs on (2.11 and 2.13).

torch 2.13 names the single-tensor collectives `all_gather_single` and
`reduce_scatter_single` and deprecates `all_gather_into_tensor` and
`reduce_scatter_tensor`; torch 2.11 has only the old names. lockstep calls them
through here: the new name where torch has it, the old one otherwise (same
arguments, same behaviour).
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_gather_single", "reduce_scatter_single"]
