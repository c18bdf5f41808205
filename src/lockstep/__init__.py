"""lockstep: distributed data-parallel training for PyTorch that you can read, measure and trust."""

from lockstep.context import DistContext, init, shutdown
from lockstep.engine.ddp import DDP, DistributedDataParallel
from lockstep.engine.naive import NaiveDataParallel
from lockstep.errors import LockstepError

__all__ = [
    "DDP",
    "DistContext",
    "DistributedDataParallel",
    "LockstepError",
    "NaiveDataParallel",
    "init",
    "shutdown",
]
