"""Full state dicts from shards, and shards from full state dicts (any world size).

`full_state_dict` all-gathers each flat and returns the plain module's state
dict: the same keys in the same order (tied weights under each name), so it
loads into the unwrapped model and into lockstep's DDP. The optimizer state is
gathered the same way, each shard-shaped tensor into the unpadded flat of its
unit; loading slices this rank's part again, so a checkpoint written at one
world size resumes at another. Every rank must call the gathering functions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lockstep.sharded.flat import FlatParam


def gather_flat(flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-shaped tensor of `flat` into its padded full length."""
    out = shard.new_empty(flat.layout.padded_numel)
    dist.all_gather_single(out, shard.detach().contiguous(), group=flat.process_group)
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


def _shard_states(optimizer: torch.optim.Optimizer, flats: list[FlatParam]) -> list[Any]:
    """For each parameter the optimizer holds, in its order: its flat, or None."""
    by_shard = {id(flat.shard): flat for flat in flats}
    return [by_shard.get(id(p)) for group in optimizer.param_groups for p in group["params"]]


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer, flats: list[FlatParam]
) -> dict[str, Any]:
    """The optimizer's state dict with every shard-shaped tensor gathered (unpadded)."""
    saved = optimizer.state_dict()
    owners = _shard_states(optimizer, flats)
    state = {}
    for index, entry in saved["state"].items():
        flat = owners[index]
        state[index] = {
            key: _gathered(flat, value) if _is_shard(flat, value) else _copy(value)
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": saved["param_groups"], "sharded": True}


def _is_shard(flat: FlatParam | None, value: Any) -> bool:
    return (
        flat is not None
        and isinstance(value, torch.Tensor)
        and value.shape == flat.shard.shape
        and value.dim() == 1
    )


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _gathered(flat: FlatParam, value: torch.Tensor) -> torch.Tensor:
    return gather_flat(flat, value)[: flat.layout.numel].clone()


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, flats: list[FlatParam], saved: dict[str, Any], rank: int
) -> None:
    """Load a state dict from `gather_optimizer_state`, at this or another world size."""
    owners = _shard_states(optimizer, flats)
    state = {}
    for index, entry in saved["state"].items():
        flat = owners[int(index)]
        state[index] = {
            key: local_slice(flat, value, rank)
            if flat is not None
            and isinstance(value, torch.Tensor)
            and value.dim() == 1
            and value.numel() == flat.layout.numel
            else value
            for key, value in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
