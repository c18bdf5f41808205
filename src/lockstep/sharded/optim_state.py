"""The sharded optimizer's state as torch's per-parameter state dict of the plain model.

The optimizer sees flat shards; a checkpoint should not depend on them. So
`gather_optimizer_state` all-gathers every shard-shaped state tensor and splits
it back into one tensor per parameter, keyed by the parameter's index in the
plain module's `parameters()`: the state dict an optimizer over the unwrapped
model (or lockstep's DDP) would have. `load_optimizer_state` concatenates each
unit's tensors again and keeps this rank's slice, so a checkpoint moves between
world sizes, stages, bucket caps and DDP. Every rank must call the gathering.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.sharded.flat import FlatParam
from lockstep.sharded.state import gather_flat, local_slice

PlainIndex = dict[int, int]  # id(original parameter) -> its index in module.parameters()


def _members(p: torch.Tensor, flats: dict[int, FlatParam], plain: PlainIndex) -> list[int]:
    """Plain indices of what optimizer parameter `p` holds: a flat's parameters, or itself."""
    flat = flats.get(id(p))
    if flat is not None:
        return [plain[id(slots.param)] for slots in flat.slots]
    if id(p) in plain:
        return [plain[id(p)]]
    raise ValueError(
        "the optimizer holds a parameter that is neither a shard of this ShardedDataParallel "
        "nor one of its module's parameters; build it from model.parameters()"
    )


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer, flats: list[FlatParam], plain: PlainIndex
) -> dict[str, Any]:
    """The optimizer's state as the plain model's per-parameter state dict (every rank)."""
    saved = optimizer.state_dict()
    by_shard = {id(flat.shard): flat for flat in flats}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for group_saved, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        members: list[int] = []
        for index, p in zip(group_saved["params"], group["params"], strict=True):
            ids = _members(p, by_shard, plain)
            members += ids
            entry = saved["state"].get(index)
            if entry is not None:
                for j, pid in enumerate(ids):
                    state[pid] = {k: _piece(by_shard.get(id(p)), v, j) for k, v in entry.items()}
        groups.append({**group_saved, "params": sorted(members)})  # the plain model's order
    return {"state": state, "param_groups": groups, "sharded": True}


def _piece(flat: FlatParam | None, value: Any, j: int) -> Any:
    """Parameter j's part of a state value: split from the gathered flat, or a copy."""
    if not isinstance(value, torch.Tensor):
        return value
    if flat is None or value.dim() != 1 or value.shape != flat.shard.shape:
        return value.detach().clone()
    return flat.full_tensors(gather_flat(flat, value))[j]


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    flats: list[FlatParam],
    plain: PlainIndex,
    saved: dict[str, Any],
    rank: int,
) -> None:
    """Load a per-parameter state dict (ours or a plain/DDP optimizer's) into the shards.

    Raises:
        ValueError: the number of parameter groups differs.
    """
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved optimizer has {len(saved['param_groups'])} parameter group(s), this one "
            f"{len(optimizer.param_groups)}; build the optimizer as the saved run did"
        )
    by_shard = {id(flat.shard): flat for flat in flats}
    state: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for group_saved, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        members = []
        for p in group["params"]:
            entries = [saved["state"].get(pid) for pid in _members(p, by_shard, plain)]
            if all(e is not None for e in entries):
                state[index] = _joined(by_shard.get(id(p)), entries, rank)
            members.append(index)
            index += 1
        groups.append({**group_saved, "params": members})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _joined(flat: FlatParam | None, entries: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """One optimizer entry from the per-parameter entries of a flat (this rank's slice)."""
    if flat is None:
        return entries[0]
    out = {}
    for key, value in entries[0].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            full = torch.cat([e[key].reshape(-1) for e in entries])
            out[key] = local_slice(flat, full, rank)
        else:
            out[key] = value
    return out
