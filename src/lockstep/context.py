"""`DistContext`: who this process is in the job, and the calls that join and leave it.

`init()` is the first line of a training script. It reads the launcher's
variables (through `lockstep.env`, the only module that does), joins the
default process group (NCCL when CUDA devices are visible, gloo otherwise),
binds the device to the local rank, and returns a frozen `DistContext` that the
rest of the script passes around explicitly. `shutdown()` leaves the group.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep import arrivals
from lockstep.env import DEFAULT_MASTER_ADDR, LaunchEnv, read_launch_env, read_timeout
from lockstep.errors import EnvironmentConfigError
from lockstep.teardown import install as _pin_groups

# Before any group exists: groups are pinned and end at a known point at exit
# (lockstep.teardown says why: an exit that hangs, or aborts, otherwise).
_pin_groups()


# How a process that replaces a lost rank joins its job's running group (`lockstep.live`
# installs it under `lockstep run --live-recovery`): (rank, world size, timeout) -> joined.
GroupJoin = Callable[[int, int, timedelta], bool]
_group_joins: list[GroupJoin] = []


def join_with(join: GroupJoin) -> None:
    """`init()` asks `join` first: True means it made the default group (idempotent)."""
    if join not in _group_joins:
        _group_joins.append(join)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. Pass it explicitly; never stash it globally.

    Attributes:
        rank: global index of this process, in [0, world_size).
        local_rank: index of this process on its node; selects its device.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, in [0, number of nodes).
        backend: the torch.distributed backend ("gloo" or "nccl").
        device: the device this process computes on.
        restart_count: how many times the launcher restarted the group so far.
        group_ranks: for a context of a process group (`group_context`), the job-wide rank
            of each member, indexed by group rank; empty when the group is the whole job.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device
    restart_count: int = 0
    group_ranks: tuple[int, ...] = ()

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs and writes checkpoints."""
        return self.rank == 0

    def global_rank(self, group_rank: int) -> int:
        """The job-wide rank of this group's member `group_rank` (the one mapping to use)."""
        return self.group_ranks[group_rank] if self.group_ranks else group_rank

    @property
    def num_nodes(self) -> int:
        """Number of nodes, assuming the same number of processes on each."""
        return max(1, self.world_size // self.local_world_size)


def _pick_device(launch: LaunchEnv, backend: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if launch.local_rank >= count:
        raise EnvironmentConfigError(
            f"LOCAL_RANK={launch.local_rank} but only {count} CUDA device(s) are visible "
            f"on this node (rank {launch.rank}); expected LOCAL_RANK < {count}. Start at most "
            f"{count} processes per node (--nproc-per-node) or check CUDA_VISIBLE_DEVICES."
        )
    torch.cuda.set_device(launch.local_rank)
    return torch.device("cuda", launch.local_rank)


def default_backend() -> str:
    """NCCL when CUDA devices are visible, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(backend: str | None = None, timeout: timedelta | None = None) -> DistContext:
    """Join the job's default process group and return this process's context.

    Safe to call when the group already exists (for example in a test harness):
    then the existing group is described, not re-created. With no launcher
    variables, a group of one is made, so the same script runs under `python`.

    Args:
        backend: "gloo" or "nccl"; by default NCCL when CUDA is visible, else gloo.
        timeout: collective timeout; default LOCKSTEP_TIMEOUT_S or 5 minutes.

    Returns:
        The frozen `DistContext`.

    Raises:
        EnvironmentConfigError: the launcher's variables are inconsistent.
    """
    launch = read_launch_env()
    if dist.is_initialized():
        backend = dist.get_backend()
        launch = _agree_with_group(launch)
    else:
        backend = backend or default_backend()
    device = _pick_device(launch, backend)
    if not dist.is_initialized():
        _join(launch, backend, timeout or read_timeout())
        atexit.register(_leave_at_exit)
    return DistContext(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        node_rank=launch.node_rank,
        backend=backend,
        device=device,
        restart_count=launch.restart_count,
    )


def _agree_with_group(launch: LaunchEnv) -> LaunchEnv:
    """Trust the existing group for rank and world size when the env says nothing."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if launch.source != "single":
        return launch
    return LaunchEnv("group", rank, rank, world_size, world_size, 0, "", 0)


def _join(launch: LaunchEnv, backend: str, timeout: timedelta) -> None:
    if launch.world_size == 1:
        # A group of one needs no rendezvous: an in-memory store is enough.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    if any(join(launch.rank, launch.world_size, timeout) for join in _group_joins):
        return  # a live replacement joined its generation's group
    # torchrun-style launchers export MASTER_ADDR/MASTER_PORT; Slurm and MPI may not.
    init_method = (
        "env://"
        if launch.source == "torchrun"
        else f"tcp://{launch.master_addr}:{launch.master_port}"
    )
    arrivals.join(launch, backend, init_method, timeout)


def _launch_env_or_single() -> LaunchEnv:
    """The launcher's variables, or "single" when they are partial (a group made by hand).

    A script that calls `init_process_group(rank=..., world_size=...)` itself may
    leave only some launcher variables set (WORLD_SIZE without RANK); the group,
    not the environment, is then the authority on rank and world size.
    """
    try:
        return read_launch_env()
    except EnvironmentConfigError:
        return LaunchEnv("single", 0, 0, 1, 1, 0, DEFAULT_MASTER_ADDR, 0)


def _leave_at_exit() -> None:
    """Destroy the group `init` made if the script did not (no `shutdown()` call).

    A group still alive while the interpreter tears down runs its backend's
    threads into freed state, which can abort a process that succeeded. After an
    uncaught exception (`sys.last_value` is set) a collective may still be in
    flight, and destroying the group could block on it: the process then leaves
    as before.
    """
    if dist.is_initialized() and not hasattr(sys, "last_value"):
        dist.destroy_process_group()


def group_context(
    process_group: dist.ProcessGroup | None = None, user: str = "lockstep"
) -> DistContext:
    """This process's place in `process_group`: the one function components derive it from.

    Rank and world size come from the group (the default group when None); the
    node facts from the launcher's variables. One default each: with no launcher
    variables the job is one node (local_world_size = world size). With no process
    group at all the process is alone (rank 0 of 1).

    Args:
        process_group: the group the component works in.
        user: the component asking, named in the error.

    Raises:
        EnvironmentConfigError: the launcher started several processes but no process
            group exists yet, so every rank would act as if it were alone.
    """
    grouped = dist.is_available() and dist.is_initialized()
    launch = _launch_env_or_single() if grouped else read_launch_env()
    if not grouped:
        if launch.world_size > 1:
            raise EnvironmentConfigError(
                f"{user} found no process group on rank {launch.rank}, although the "
                f"launcher started {launch.world_size} processes; every rank would act alone "
                f"(read all the data, write every checkpoint). Call lockstep.init() before "
                f"{user}."
            )
        return DistContext(0, 0, 1, 1, 0, "none", torch.device("cpu"))
    rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
    known = launch.source != "single" and launch.world_size == dist.get_world_size()
    local_world_size = min(launch.local_world_size, world_size) if known else world_size
    return DistContext(
        rank=rank,
        local_rank=launch.local_rank if known else rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=launch.node_rank if known else 0,
        backend=dist.get_backend(process_group),
        device=_group_device(process_group),
        restart_count=launch.restart_count,
        group_ranks=_members(process_group),
    )


def _members(process_group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of the group's members, or () when it is the default group."""
    if process_group is None or process_group == dist.group.WORLD:
        return ()
    return tuple(dist.get_process_group_ranks(process_group))


def _group_device(process_group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    """Leave the default process group; a no-op when there is none."""
    if dist.is_initialized():
        dist.destroy_process_group()
