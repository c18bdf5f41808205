"""Per-unit `reshard_after_forward` of stage 3: which units stay gathered until backward.

FSDP2 takes the choice per `fully_shard` call; here one argument of the wrapper
gives it for every wrapped unit: a bool (or int) for all of them, a mapping from
a module class or a unit's qualified name to a value (units it does not name
reshard, FSDP2's default), or a callable `(name, module) -> value or None`. An
int is FSDP2's "reshard to a world of this size": 1 is False and the world size
is True; a size between them is refused, because the flat layout keeps one shard
per rank of the whole group. The root unit stays gathered (FSDP2's root default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

ReshardRule = bool | int | Mapping[Any, bool | int] | Callable[[str, nn.Module], bool | int | None]


def _as_bool(value: object, world_size: int, where: str) -> bool:
    """FSDP2's bool-or-int value as a bool: 1 -> False, world_size -> True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (1, world_size):
        return value == world_size
    if isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward={value} for {where}: resharding to a world of {value} "
            f"ranks is not supported on the flat layout (one shard per rank of all "
            f"{world_size}); use True (reshard to {world_size}) or False (keep gathered)"
        )
    raise ValueError(f"reshard_after_forward for {where} expects a bool or an int; found {value!r}")


def _lookup(rule: Mapping[Any, Any], name: str, module: nn.Module) -> object:
    if name in rule:
        return rule[name]
    for key, value in rule.items():
        if isinstance(key, type) and isinstance(module, key):
            return value
    return True


def resolve_reshard(
    rule: ReshardRule, units: Sequence[tuple[str, nn.Module]], world_size: int
) -> dict[str, bool]:
    """Whether each wrapped unit reshards after forward.

    Args:
        rule: the wrapper's `reshard_after_forward` argument.
        units: (qualified name, module) of each wrapped unit.
        world_size: the size of the group the shards are spread over.

    Returns:
        Unit name -> True (free after forward, gather again in backward) or False.

    Raises:
        ValueError: a value that is neither bool nor a supported int, or a mapping key
            (a class or a name) that matches no unit.
    """
    if isinstance(rule, Mapping):
        unmatched = [k for k in rule if not _matches(k, units)]
        if unmatched:
            names = [n for n, _ in units]
            raise ValueError(
                f"reshard_after_forward keys {unmatched} match no wrapped unit; "
                f"the units are {names[:8]} (key them by class or by qualified name)"
            )
    out = {}
    for name, module in units:
        if isinstance(rule, Mapping):
            value = _lookup(rule, name, module)
        elif callable(rule):
            value = rule(name, module)
            value = True if value is None else value
        else:
            value = rule
        out[name] = _as_bool(value, world_size, f"unit {name!r}")
    return out


def _matches(key: object, units: Sequence[tuple[str, nn.Module]]) -> bool:
    if isinstance(key, type):
        return any(isinstance(m, key) for _, m in units)
    return any(key == n for n, _ in units)


def reshard_problem(
    rule: ReshardRule, stage: int, units: Sequence[tuple[str, nn.Module]], world_size: int
) -> tuple[str | None, list[str]]:
    """(what is wrong with `rule`, or None; the units that stay gathered), for the checks."""
    if stage != 3:
        if rule is True:
            return None, []
        return f"reshard_after_forward applies to stage 3 only; found stage={stage}", []
    try:
        kept = [n for n, keep in resolve_reshard(rule, units, world_size).items() if not keep]
    except ValueError as error:
        return str(error), []
    return None, kept
