"""lockstep: distributed data-parallel training for PyTorch that you can read, measure and trust."""

from lockstep.context import DistContext, init, shutdown
from lockstep.engine.naive import NaiveDataParallel
from lockstep.errors import LockstepError

__all__ = [
    "DistContext",
    "LockstepError",
    "NaiveDataParallel",
    "init",
    "shutdown",
]
