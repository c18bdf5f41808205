"""The sharded engine's state in the shape of FSDP2's `get_state_dict`, each rank its own part.

Saving: the model's entries are keyed by the plain module's names (no wrapper
prefix), each flat parameter a `FlatPiece` of this rank's shard; the optimizer's
are `state[fqn][name]` (per-element state as pieces of the shard-shaped state,
scalars such as Adam's `step` as they are) and `param_groups` with the names of
their parameters, as torch's `get_state_dict(model, optimizer)` gives for a
`fully_shard` model. Nothing is gathered. Loading: the same pieces, made from
what the checkpoint's metadata says it holds, are DCP's targets (whatever layout
and world size wrote it); `apply_optimizer` then hands them to the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lockstep.sharded.dcp_pieces import piece_of
from lockstep.sharded.engine import ShardedDataParallel
from lockstep.sharded.flat import FlatParam
from lockstep.sharded.state import flat_entries, gather_flat

OPTIMIZER = "optimizer"


def model_state(model: ShardedDataParallel) -> dict[str, Any]:
    """Model entries by plain name: pieces of this rank's shards, buffers and the rest as is."""
    rest = model.module.state_dict()
    entries = flat_entries(model.flats)
    out: dict[str, Any] = {}
    for key in model.state_dict_keys():
        if key in entries:
            flat, i = entries[key]
            out[key] = piece_of(flat, i, flat.shard.data)
        else:
            out[key] = rest[key]
    return out


def after_model_load(model: ShardedDataParallel) -> None:
    """Stages 1 and 2 keep the full parameters: gather them from the loaded shards."""
    for flat in model.flats:
        if flat.keep_full:
            with torch.no_grad():
                flat.full.data.copy_(gather_flat(flat, flat.shard.data))


def _names(model: ShardedDataParallel, optimizer: torch.optim.Optimizer) -> list[list[tuple]]:
    """Per group, per optimizer parameter: (parameter, flat or None, [(fqn, index in flat)])."""
    by_shard = {id(flat.shard): flat for flat in model.flats}
    plain = {id(p): n for n, p in model.module.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        members = []
        for p in group["params"]:
            flat = by_shard.get(id(p))
            if flat is not None:
                members.append((p, flat, [(s.names[0], i) for i, s in enumerate(flat.slots)]))
            elif id(p) in plain:
                members.append((p, None, [(plain[id(p)], 0)]))
            else:
                raise ValueError(
                    "the optimizer holds a parameter that is neither a shard of this "
                    "ShardedDataParallel nor one of its module's parameters; build it from "
                    "model.parameters()"
                )
        groups.append(members)
    return groups


def optimizer_state(model: ShardedDataParallel, optimizer: torch.optim.Optimizer) -> dict:
    """`{"state": {fqn: {name: value}}, "param_groups": [...]}`, per-element state as pieces."""
    order = {key: i for i, key in enumerate(model.state_dict_keys())}
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group, members in zip(optimizer.param_groups, _names(model, optimizer), strict=True):
        fqns = []
        for p, flat, names in members:
            entry = optimizer.state.get(p, {})
            for fqn, i in names:
                fqns.append(fqn)
                if entry:
                    state[fqn] = {k: _value(flat, i, v) for k, v in entry.items()}
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": sorted(fqns, key=order.__getitem__)})
    return {"state": state, "param_groups": groups}


def _value(flat: FlatParam | None, i: int, value: Any) -> Any:
    """Parameter i's part of a state value: a piece of shard-shaped state, else the value."""
    if flat is not None and isinstance(value, torch.Tensor) and value.shape == flat.shard.shape:
        return piece_of(flat, i, value)
    return value


def _saved_names(metadata: Metadata, fqn: str) -> dict[str, Any]:
    prefix = f"{OPTIMIZER}.state.{fqn}."
    found = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and "." not in key[len(prefix) :]:
            found[key[len(prefix) :]] = md
    return found


def _holder(flat: FlatParam | None, shape: torch.Size, md: Any) -> Any:
    """What the optimizer will hold for one saved state value (None: read as bytes)."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    dtype = md.properties.dtype
    if flat is not None and md.size == shape and len(shape) > 0:  # per element: shard-shaped
        return torch.zeros(flat.shard.numel(), dtype=dtype, device=flat.shard.device)
    return torch.empty(md.size, dtype=dtype)


def _target(flat: FlatParam | None, i: int, holder: Any) -> Any:
    """DCP's target for parameter i's saved value: a piece of a shard-shaped holder, or it."""
    if flat is not None and isinstance(holder, torch.Tensor) and holder.shape == flat.shard.shape:
        return piece_of(flat, i, holder)
    return holder


def optimizer_targets(
    model: ShardedDataParallel, optimizer: torch.optim.Optimizer, metadata: Metadata
) -> tuple[dict[str, Any], list]:
    """Flat DCP keys -> load targets for the optimizer, and what `apply_optimizer` needs.

    Raises:
        ValueError: some of a flat's parameters have saved state and others do not.
    """
    targets: dict[str, Any] = {}
    plan = []
    for members in _names(model, optimizer):
        for p, flat, names in members:
            saved = [_saved_names(metadata, fqn) for fqn, _ in names]
            if not any(saved):
                continue
            if not all(saved):
                missing = [fqn for (fqn, _), s in zip(names, saved, strict=True) if not s]
                raise ValueError(f"the checkpoint holds no optimizer state for {missing[:6]}")
            entry: dict[str, Any] = {}
            for (fqn, i), found in zip(names, saved, strict=True):
                shape = flat.shapes[i] if flat is not None else p.shape
                for name, md in found.items():
                    key = f"{OPTIMIZER}.state.{fqn}.{name}"
                    if name not in entry:
                        entry[name] = (key, _holder(flat, shape, md))
                    targets[key] = _target(flat, i, entry[name][1])
            plan.append((p, entry))
    for key in metadata.state_dict_metadata:
        if key.startswith(f"{OPTIMIZER}.param_groups."):
            targets[key] = None
    return targets, plan


def apply_optimizer(
    model: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, Any],
    plan: list,
) -> None:
    """Give the optimizer the state DCP read into `loaded` (from `optimizer_targets`).

    Raises:
        ValueError: the saved parameter groups do not match this optimizer's.
    """
    index = {id(p): n for n, p in enumerate(q for g in optimizer.param_groups for q in g["params"])}
    state = {}
    for p, entry in plan:
        state[index[id(p)]] = {
            name: loaded[key] if value is None else value for name, (key, value) in entry.items()
        }
    saved = _saved_groups(loaded)
    groups = []
    for members, group in zip(_names(model, optimizer), optimizer.param_groups, strict=True):
        fqns = {fqn for _, _, names in members for fqn, _ in names}
        match = next((g for g in saved if set(g.get("params", [])) == fqns), None)
        if match is None:
            raise ValueError(
                f"no saved parameter group holds exactly this optimizer's group of "
                f"{sorted(fqns)[:6]}; build the optimizer's groups as the saved run did"
            )
        hyper = {k: v for k, v in match.items() if k != "params"}
        groups.append({**hyper, "params": [index[id(p)] for p in group["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _saved_groups(loaded: dict[str, Any]) -> list[dict[str, Any]]:
    prefix = f"{OPTIMIZER}.param_groups."
    groups: dict[int, dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith(prefix):
            number, name = key[len(prefix) :].split(".", 1)
            groups.setdefault(int(number), {})[name] = value
    return [groups[n] for n in sorted(groups)]
