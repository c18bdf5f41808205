"""Full state dicts from shards, and shards from full state dicts (any world size).

`full_state_dict` all-gathers each flat and returns the plain module's state
dict: the same keys in the same order (tied weights under each name), so it
loads into the unwrapped model and into lockstep's DDP; loading keeps this
rank's slice of each flat, at any world size (the optimizer's state:
`optim_state.py`). Every rank must call the gathering functions.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.collectives.torch_compat import all_gather_single
from lockstep.sharded.flat import FlatParam


def gather_flat(flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-shaped tensor of `flat` into its padded full length."""
    out = shard.new_empty(flat.layout.padded_numel)
    all_gather_single(out, shard.detach().contiguous(), group=flat.process_group)
    return out


def local_slice(flat: FlatParam, full: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's shard of `full` (unpadded or padded length), padded with zeros."""
    padded = full.new_zeros(flat.layout.padded_numel)
    padded[: flat.layout.numel] = full.reshape(-1)[: flat.layout.numel]
    start, end = flat.layout.shard_range(rank)
    return padded[start:end].clone()


def flat_entries(flats: list[FlatParam]) -> dict[str, tuple[FlatParam, int]]:
    """State-dict key -> (flat, parameter index) for every parameter name held in a flat."""
    out = {}
    for flat in flats:
        for i, slots in enumerate(flat.slots):
            for name in slots.names:
                out[name] = (flat, i)
    return out


def full_state_dict(
    flats: list[FlatParam], keys: list[str], rest: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The plain module's state dict: gathered flat parameters, `rest` for the others.

    Args:
        flats: every flat of the model.
        keys: the plain module's state-dict keys, in order (recorded at wrap time).
        rest: parameters outside flats and buffers, by key (the module's own state dict).
    """
    tensors: dict[int, list[torch.Tensor]] = {}
    for flat in flats:
        tensors[flat.index] = flat.full_tensors(gather_flat(flat, flat.shard.data))
    entries = flat_entries(flats)
    out = {}
    for key in keys:
        if key in entries:
            flat, i = entries[key]
            out[key] = tensors[flat.index][i]
        else:
            out[key] = rest[key]
    return out


def load_flats(flats: list[FlatParam], state: dict[str, Any], rank: int) -> None:
    """Copy this rank's shard of each flat (and `full`, where kept) from a full state dict."""
    for flat in flats:
        values = [state[slots.names[0]].reshape(-1) for slots in flat.slots]
        full = torch.cat([v.to(flat.shard.dtype) for v in values])
        with torch.no_grad():
            flat.shard.copy_(local_slice(flat, full, rank))
            if flat.keep_full:
                start, end = flat.layout.shard_range(rank)
                gathered = flat.full.data
                gathered[: flat.layout.numel].copy_(full)
                gathered[start:end].copy_(flat.shard.data)
