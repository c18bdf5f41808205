"""Construction-time agreement check: every rank must hold the same parameters.

Each rank describes its trainable parameters (name, shape, dtype) and all
descriptions are gathered, so every rank sees every other rank's list and
raises the same error. Comparing lists, not counts, means a mismatch is named
precisely and never turns into a hang or a garbled all-reduce later.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.collectives.agreement import differing_ranks, gather_from_ranks
from lockstep.errors import RankMismatchError

Signature = list[tuple[str, tuple[int, ...], str]]


def signature(named_params: Sequence[tuple[str, torch.Tensor]]) -> Signature:
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in named_params]


def first_difference(reference: Signature, other: Signature) -> str | None:
    """Describe the first place where `other` differs from `reference`, or None."""
    for i, (ref, oth) in enumerate(zip(reference, other, strict=False)):
        if ref != oth:
            return f"parameter #{i}: {ref[0]} {ref[1]} {ref[2]} vs {oth[0]} {oth[1]} {oth[2]}"
    if len(reference) != len(other):
        shorter = min(len(reference), len(other))
        extra = (reference if len(reference) > shorter else other)[shorter]
        return (
            f"parameter count: {len(reference)} vs {len(other)} "
            f"(first extra: {extra[0]} {extra[1]} {extra[2]})"
        )
    return None


def verify_same_parameters(
    named_params: Sequence[tuple[str, torch.Tensor]],
    process_group: dist.ProcessGroup | None,
) -> None:
    """Raise on every rank unless all ranks hold the same trainable parameters.

    Raises:
        RankMismatchError: naming the first differing parameter and the ranks that differ.
    """
    gathered = gather_from_ranks(signature(named_params), process_group)
    differing = [
        (rank, first_difference(gathered[0], gathered[rank])) for rank in differing_ranks(gathered)
    ]
    if differing:
        ranks = [rank for rank, _ in differing]
        first_rank, first_diff = differing[0]
        raise RankMismatchError(
            f"DistributedDataParallel expected every rank to hold the same trainable "
            f"parameters as rank 0, but rank(s) {ranks} differ (seen on rank "
            f"{dist.get_rank()}); first difference, rank 0 vs rank {first_rank}: {first_diff}. "
            "Build the same model on every rank (same config, same requires_grad settings) "
            "before wrapping it."
        )
