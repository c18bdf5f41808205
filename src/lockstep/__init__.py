"""lockstep: distributed data-parallel training for PyTorch that you can read, measure and trust."""

from lockstep.checkpoint import Checkpointer
from lockstep.context import DistContext, init, shutdown
from lockstep.data import ShardedSampler, shard
from lockstep.engine.ddp import DDP, DistributedDataParallel
from lockstep.engine.naive import NaiveDataParallel
from lockstep.env import read_variable as _read_variable
from lockstep.errors import LockstepError
from lockstep.live import install as _install_live_recovery
from lockstep.observe.monitor import Monitor
from lockstep.observe.trace_hook import attach_env_tracer  # noqa: F401  (LOCKSTEP_TRACE)
from lockstep.sharded import FSDP, MixedPrecisionPolicy, ShardedDataParallel

_install_live_recovery()  # under `lockstep run --live-recovery` only (lockstep/live/__init__.py)

if _read_variable("LOCKSTEP_ENGINE"):  # torch's DDP builds lockstep's engine: docs/frameworks.md
    from lockstep.adopt import install_from_env

    install_from_env()

__all__ = [
    "DDP",
    "FSDP",
    "Checkpointer",
    "DistContext",
    "DistributedDataParallel",
    "LockstepError",
    "MixedPrecisionPolicy",
    "Monitor",
    "NaiveDataParallel",
    "ShardedDataParallel",
    "ShardedSampler",
    "init",
    "shard",
    "shutdown",
]
