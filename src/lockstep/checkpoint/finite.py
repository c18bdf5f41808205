"""A checkpoint holding NaN or inf is never committed: the last finite one stays in charge.

Before rank 0 writes, every floating-point tensor of the payload (the model, the
optimizer state, `extra`) is checked. A non-finite one makes the save fail on
every rank with its name; the state is written aside, as
`step_00000005.nonfinite.pt` (the newest only), for inspection. That file is never a restore
candidate, never named by `latest` and never counted by `keep=`, so pruning can
never remove the last finite checkpoint in its favour.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".nonfinite.pt"


def first_nonfinite(value: Any, where: str = "checkpoint") -> str | None:
    """'model['fc.weight'] holds NaN' for the first non-finite tensor in `value`, else None."""
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()):
            return None
        if bool(torch.isfinite(value).all()):
            return None
        kind = "NaN" if bool(torch.isnan(value).any()) else "inf"
        return f"{where} holds {kind}"
    if isinstance(value, dict):
        items = [(f"{where}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
    else:
        return None
    for place, item in items:
        found = first_nonfinite(item, place)
        if found is not None:
            return found
    return None


def write_aside(directory: Path, step: int, payload: dict[str, Any]) -> str:
    """Write `payload` as `step_<step>.nonfinite.pt` (never a restore candidate); its path.

    Only the newest such file is kept, so a loop that goes on saving cannot fill the
    disk with them. Returns the reason instead when it cannot be written (the refusal
    stands either way).
    """
    path = directory / f"step_{step:08d}{SUFFIX}"
    tmp = directory / f".{path.name}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob(f"*{SUFFIX}"):
            old.unlink(missing_ok=True)
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        return f"nowhere ({error})"
    return str(path)


def refusal(step: int, found: str, aside: str, committed: int | None) -> str:
    """The error message of a refused save."""
    last = f"step {committed}" if committed is not None else "none yet"
    return (
        f"rank 0 refused to commit checkpoint step {step}: {found}; expected finite "
        f"values. The state was written aside to {aside} for inspection; the last "
        f"committed checkpoint ({last}) stays the restore point and is not pruned. The run "
        "diverged: restore from it (a lower learning rate, another seed), or find the step "
        "where the gradients turned non-finite (the engines stop there by default, "
        "docs/engine.md)."
    )
