"""Which parameters travel together: the units of the sharded engine.

A unit is the group of parameters that is flattened, sharded, gathered and
reduced as one. Stages 1 and 2 use DDP's buckets (`runtime/bucketing.py`), so
gradients of the last layers leave while backward goes on. Stage 3 makes each
module of a `wrap` class its own unit (gathered just before it runs, freed
after), and puts every other trainable parameter in the root unit. A parameter
used in two wrapped modules (tied weights) belongs to the root unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lockstep.runtime.bucketing import assign_buckets, param_specs

ROOT = ""


@dataclass
class ParamSlots:
    """One parameter and every (module, attribute) that holds it.

    Attributes:
        param: the parameter as the plain module holds it.
        names: its qualified names, first one first (tied weights have several).
        owners: (module, attribute name) pairs, one per name.
    """

    param: nn.Parameter
    names: list[str] = field(default_factory=list)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class UnitSpec:
    """A unit before flattening: its name, its module (stage 3) and its parameters."""

    name: str
    module: nn.Module | None
    params: list[ParamSlots]


def collect_params(module: nn.Module, trainable_only: bool = True) -> list[ParamSlots]:
    """Every (trainable) parameter once, in registration order, with all its places."""
    by_id: dict[int, ParamSlots] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, param in owner._parameters.items():
            if param is None or (trainable_only and not param.requires_grad):
                continue
            slots = by_id.setdefault(id(param), ParamSlots(param))
            if (owner, attr) not in [(m, a) for m, a in slots.owners]:
                slots.names.append(f"{prefix}.{attr}" if prefix else attr)
                slots.owners.append((owner, attr))
    return list(by_id.values())


def owning_unit(names: Sequence[str], unit_paths: Sequence[str]) -> str:
    """The unit that owns a parameter known by `names`: pure, for unit tests.

    Args:
        names: the parameter's qualified names (several when it is tied).
        unit_paths: qualified names of the wrapped modules (none inside another).

    Returns:
        The path of the wrapped module that holds every name, else ROOT ("").
    """
    found = set()
    for name in names:
        owner = next((p for p in unit_paths if name.startswith(p + ".")), ROOT)
        found.add(owner)
    return found.pop() if len(found) == 1 else ROOT


def wrapped_modules(module: nn.Module, wrap: Sequence[type]) -> list[tuple[str, nn.Module]]:
    """The outermost submodules that are instances of a `wrap` class, in registration order."""
    out: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if not name or not isinstance(sub, tuple(wrap)):
            continue
        if any(name.startswith(p + ".") for p, _ in out):
            continue
        out.append((name, sub))
    return out


def bucket_units(
    trainable: list[ParamSlots], first_cap_bytes: int, cap_bytes: int
) -> list[UnitSpec]:
    """Stages 1 and 2: one unit per DDP bucket, in launch order."""
    specs = param_specs([(s.names[0], s.param) for s in trainable])
    buckets = assign_buckets(specs, first_cap_bytes=first_cap_bytes, cap_bytes=cap_bytes)
    # Inside a bucket, registration order: the flat buffer then reads like the module.
    return [
        UnitSpec(f"bucket{i}", None, [trainable[j] for j in sorted(b)])
        for i, b in enumerate(buckets)
    ]


def wrap_units(module: nn.Module, params: list[ParamSlots], wrap: Sequence[type]) -> list[UnitSpec]:
    """Stage 3: the root unit (if it holds anything) first, then one per wrapped module.

    Frozen parameters are sharded too (in their own flats), as ZeRO-3 counts them.
    """
    wrapped = wrapped_modules(module, wrap)
    paths = [p for p, _ in wrapped]
    groups: dict[str, list[ParamSlots]] = {p: [] for p in [ROOT, *paths]}
    for slots in params:
        groups[owning_unit(slots.names, paths)].append(slots)
    units = [UnitSpec("root", None, groups[ROOT])] if groups[ROOT] else []
    units += [UnitSpec(p, m, groups[p]) for p, m in wrapped if groups[p]]
    return units
