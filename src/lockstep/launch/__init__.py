"""`lockstep run`: a front on torch.distributed.elastic that starts, watches and reports workers."""

from lockstep.launch.cli.config import RunConfig
from lockstep.launch.supervise.runner import run

__all__ = ["RunConfig", "run"]
