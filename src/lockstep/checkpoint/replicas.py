"""A checkpoint is committed only when every rank holds the same state.

The step check (`runtime/replica_check.py`) compares parameters and buffers at every
step; the optimizer state shows there only a step later, through the parameters it
moves. So at each `save()` every rank digests its parameters and its optimizer's
state (`replica_digest.host_digest`: host reads, a save is rare), rank 0 gathers
them, and commits only when every rank's digests are the same. A checkpoint taken
while replicas differed is never written, so it never becomes `latest`: the last
one every rank agreed on stays the restore point, and the save fails on every rank
naming the ranks that differ (with two replicas, both) and the first entry.

`restore()` does the same after loading (`loaded_differently`): every rank must
hold the same state once it has read the checkpoint, which it reads from its own
disk; the rank that does not is named.

Buffers are not compared here: BatchNorm's running statistics move with each
rank's batch. LOCKSTEP_CHECK_REPLICAS=0 or `Checkpointer(check_replicas=False)`
switches it off.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lockstep.runtime.replica_digest import host_digest, judge

Digests = list[tuple[str, int]]


def state_digests(model: nn.Module, optimizer: Any) -> Digests:
    """(entry, digest) for each parameter and each optimizer-state entry, in a fixed order."""
    module = getattr(model, "module", model)  # the wrapper's state dict is the module's
    named = list(module.named_parameters())
    found: Digests = [(f"parameter '{name}'", host_digest(p)) for name, p in named]
    if optimizer is None or not hasattr(optimizer, "state_dict"):
        return found
    by_id = {id(p): name for name, p in named}
    ordered = [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
    try:
        state = optimizer.state_dict().get("state", {})
    except RuntimeError:  # one that gathers its state first (torch's ZeroRedundancyOptimizer)
        return found
    for index in sorted(state, key=str):
        name = by_id.get(id(ordered[index]), str(index)) if index < len(ordered) else str(index)
        entry = state[index]
        for key in sorted(entry, key=str) if isinstance(entry, dict) else []:
            found.append((f"optimizer state '{key}' of '{name}'", host_digest(entry[key])))
    return found


def differing(everyone: list[Digests]) -> str | None:
    """'rank(s) [1] hold ... ; the first that differs is ...', or None when all agree."""
    if all(mine == everyone[0] for mine in everyone):
        return None
    if len({len(mine) for mine in everyone}) > 1:
        sizes = ", ".join(f"rank {r}: {len(mine)}" for r, mine in enumerate(everyone))
        return f"the ranks hold different numbers of parameters and state entries ({sizes})"
    verdict = judge([[d for _, d in mine] for mine in everyone])
    where = everyone[0][verdict.first][0] if verdict.first >= 0 else "(not located)"
    if verdict.majority:
        who = (
            f"rank(s) {list(verdict.differing)} hold another state than the majority, "
            f"rank(s) {list(verdict.majority)}"
        )
    else:
        who = f"rank(s) {list(verdict.differing)} hold different states and no majority agrees"
    return f"{who}; the first that differs is {where}"


def save_refusal(step: int, found: str, committed: int | None) -> str:
    """The error of a save refused because the replicas differ."""
    last = f"step {committed}" if committed is not None else "none yet"
    return (
        f"rank 0 refused to commit checkpoint step {step}: the replicas differ: {found}. "
        f"Expected every rank to hold the same parameters and optimizer state. The last "
        f"checkpoint every rank agreed on ({last}) stays `latest`. Restore from it; a "
        "rank-local write to the model or the optimizer, a checkpoint loaded on one rank "
        "only or a memory fault makes a replica differ (LOCKSTEP_CHECK_REPLICAS=0 or "
        "Checkpointer(check_replicas=False) switches this check off)."
    )


def restore_refusal(path: str, found: str) -> str:
    """The error of a restore after which the ranks hold different states."""
    return (
        f"after loading {path}, the replicas differ: {found}. Expected every rank to load "
        "the same state: the rank(s) named read another file than the others (a copy on "
        "its own disk that differs, a file replaced on one node). Make every rank see the "
        "same checkpoint file, then restore again."
    )
