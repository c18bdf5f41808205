"""The wrapper's optional modes, resolved and checked before any collective runs.

`ShardedDataParallel` takes a mixed-precision policy (`precision.py`) and a
per-unit `reshard_after_forward` (`reshard.py`). Both are resolved here on
each rank into a description that every rank compares (`arguments.py`), and
into a problem message, so that a bad value raises the same error everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lockstep.sharded.precision import MixedPrecisionPolicy, as_policy, policy_problem
from lockstep.sharded.reshard import ReshardRule, reshard_problem
from lockstep.sharded.units import wrapped_modules


@dataclass(frozen=True)
class Modes:
    """The resolved modes: the policy, the units kept gathered, and a problem if any."""

    policy: MixedPrecisionPolicy | None
    kept: tuple[str, ...]
    problem: str | None

    def setting(self) -> dict[str, object]:
        """What must agree between ranks."""
        return {"mp": self.policy.describe() if self.policy else None, "kept": list(self.kept)}


def resolve_modes(
    module: nn.Module,
    stage: object,
    wrap: Sequence[type] | None,
    mp_policy: Any,
    reshard_after_forward: ReshardRule,
    world_size: int,
) -> Modes:
    """Resolve the policy and the reshard rule on this rank; a problem is reported, not raised."""
    try:
        policy = as_policy(mp_policy)
    except TypeError as error:
        return Modes(None, (), str(error))
    units: list[tuple[str, nn.Module]] = []
    if stage == 3 and wrap and all(isinstance(w, type) for w in wrap):
        units = wrapped_modules(module, wrap)
    problem, kept = reshard_problem(reshard_after_forward, stage, units, world_size)  # type: ignore[arg-type]
    if problem is None and isinstance(stage, int):
        problem = policy_problem(module, stage, policy)
    return Modes(policy, tuple(kept), problem)
