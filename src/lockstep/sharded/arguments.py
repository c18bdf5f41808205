"""Arguments checked on every rank together, so a bad one raises everywhere instead of hanging.

Each rank checks its own arguments (stage, wrap classes) into an error message
or None, and sends it with a description of its setting to every other rank.
Every rank then raises the same error: the first rank that found a problem, or
the ranks whose setting differs from rank 0's. Only then does wrapping run
collectives that assume agreement (the parameter check, the broadcast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from lockstep.collectives.agreement import differing_ranks, gather_from_ranks
from lockstep.sharded.units import wrapped_modules

STAGES = (1, 2, 3)


def local_problem(module: nn.Module, stage: object, wrap: Sequence[type] | None) -> str | None:
    """What is wrong with this rank's arguments, or None."""
    if isinstance(stage, bool) or stage not in STAGES:
        return (
            f"stage must be 1, 2 or 3; found {stage!r}. Pick 1 (optimizer state sharded), "
            "2 (also gradients) or 3 (also weights)."
        )
    if not any(p.requires_grad for p in module.parameters()):
        return "expected a module with at least one parameter that requires grad; found none"
    if wrap is None:
        return None
    if stage != 3:
        return f"wrap applies to stage 3 only; found wrap={_names(wrap)} with stage={stage}"
    if not wrapped_modules(module, wrap):
        found = sorted({type(m).__name__ for m in module.modules()})
        return (
            f"wrap={_names(wrap)} matches no submodule of {type(module).__name__}; its module "
            f"classes are {found}. Name the class of the repeated block (a transformer layer)."
        )
    return None


def _names(wrap: Sequence[type]) -> list[str]:
    return [getattr(w, "__name__", str(w)) for w in wrap]


def check_arguments(
    module: nn.Module,
    setting: dict[str, object],
    wrap: Sequence[type] | None,
    process_group: dist.ProcessGroup | None,
    problem: str | None = None,
) -> None:
    """Raise the same ValueError on every rank if any rank's arguments are wrong or differ.

    Args:
        module: this rank's model.
        setting: this rank's arguments that must agree (stage, wrap names, bucket cap).
        wrap: the wrap classes.
        process_group: the group of ranks.
        problem: what the engine found wrong with its other arguments, if anything.

    Raises:
        ValueError: naming the rank, what was expected and what was found.
    """
    mine = (local_problem(module, setting["stage"], wrap) or problem, setting)
    gathered = gather_from_ranks(mine, process_group)
    here = dist.get_rank(process_group)
    for rank, entry in enumerate(gathered):
        if entry[0] is not None:
            raise ValueError(
                f"ShardedDataParallel on rank {rank}: {entry[0]} (raised on rank {here})"
            )
    reference = gathered[0][1]
    differ = differing_ranks(gathered, lambda a, b: a[1] == b[1])
    if differ:
        raise ValueError(
            f"ShardedDataParallel expected every rank to pass rank 0's arguments {reference}; "
            f"rank(s) {differ} passed {gathered[differ[0]][1]} (raised on rank {here}). "
            "Build the wrapper with the same stage, wrap and bucket_cap_mb everywhere."
        )
