"""`lockstep run`: a front on torch.distributed.elastic that starts, watches and reports workers."""

from lockstep.launch.config import RunConfig
from lockstep.launch.runner import run

__all__ = ["RunConfig", "run"]
