"""Which of torch's DDP arguments the installed torch has, read from its signature.

lockstep follows torch 2.13's `DistributedDataParallel`; the GPU machines carry
torch 2.11. A comparison against torch's class passes an argument to torch only
if its constructor takes it; otherwise the comparison is skipped and says so
(`missing_ddp_arguments`), rather than failing on a `TypeError`. The answer is
read with `inspect.signature` at run time, never from a table of versions.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from functools import cache

import torch


@cache
def ddp_arguments() -> frozenset[str]:
    """Names of the installed torch DDP constructor's parameters (without `self`)."""
    signature = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__)
    return frozenset(name for name in signature.parameters if name != "self")


def missing_ddp_arguments(names: Iterable[str]) -> list[str]:
    """Those of `names` that the installed torch's DDP does not take, in the given order."""
    have = ddp_arguments()
    return [name for name in names if name not in have]


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, for tables."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# lockstep's own keyword arguments: never torch's, so never "missing" from torch.
LOCKSTEP_ONLY = frozenset(
    {
        "first_bucket_cap_mb",
        "allreduce",
        "local_world_size",
        "check_data_passes",
        "nonfinite",
        "check_replicas",
    }
)


def absent_from_installed_torch() -> list[str]:
    """The torch DDP arguments lockstep follows (torch 2.13's) that the installed torch lacks."""
    from dataclasses import fields

    from lockstep.engine.args import DDPArguments

    ours = [f.name for f in fields(DDPArguments) if f.name not in LOCKSTEP_ONLY]
    return missing_ddp_arguments(ours)
