"""Units into flat parameters: one `FlatParam` per (unit, dtype, trainable).

A unit's parameters are grouped by dtype and by whether they train, because a
flat is one buffer of one dtype and only trainable flats are reduced. Each flat
is split over the shard group (`ShardMesh`: the whole group, or a node's ranks
under HSDP) and gets the dtypes the mixed-precision policy gives its own
parameters (`precision.flat_dtypes`).
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.sharded.flat import FlatParam
from lockstep.sharded.gather import Unit
from lockstep.sharded.mesh import ShardMesh
from lockstep.sharded.precision import flat_dtypes
from lockstep.sharded.units import UnitSpec


def build_flats(
    specs: list[UnitSpec], mesh: ShardMesh, keep_full: bool, policy: Any
) -> tuple[list[FlatParam], list[Unit]]:
    """The flats of every unit, numbered in order, and the units that own them.

    Args:
        specs: the units (`units.bucket_units` or `units.wrap_units`).
        mesh: the shard group this rank belongs to.
        keep_full: stages 1 and 2 keep the full buffer between steps.
        policy: the mixed-precision policy, or None.
    """
    flats: list[FlatParam] = []
    units = []
    for spec in specs:
        by_kind: dict[tuple[torch.dtype, bool], list] = {}
        for slots in spec.params:
            by_kind.setdefault((slots.param.dtype, slots.param.requires_grad), []).append(slots)
        unit_flats = []
        for (dtype, _), group in by_kind.items():
            flat = FlatParam(
                len(flats),
                spec.name,
                group,
                mesh.shard_rank,
                mesh.shard_size,
                mesh.shard_group,
                keep_full=keep_full,
                dtypes=flat_dtypes(policy, dtype),  # this group's own dtype
            )
            flats.append(flat)
            unit_flats.append(flat)
        units.append(Unit(spec.name, spec.module, unit_flats))
    return flats, units
