"""Read who-am-I from the environment: the one module that looks at launcher variables.

Three sources are understood, in this order: the variables that `lockstep run`
and torchrun set (RANK, WORLD_SIZE, ...), Slurm's (SLURM_PROCID, ...), and
OpenMPI's (OMPI_COMM_WORLD_RANK, ...). With none of them the process is alone
(world size 1), so a script runs the same under plain `python`. Everything here
is pure: it takes a mapping and returns a frozen `LaunchEnv`, which
`lockstep.context.init` turns into a process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from lockstep.errors import EnvironmentConfigError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT = timedelta(minutes=5)
TIMEOUT_VARIABLE = "LOCKSTEP_TIMEOUT_S"
TRACE_VARIABLE = "LOCKSTEP_TRACE"
TRACE_FLUSH_VARIABLE = "LOCKSTEP_TRACE_FLUSH_S"
DEFAULT_TRACE_FLUSH_S = 5.0


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about its place in the job."""

    source: str  # "torchrun", "slurm", "openmpi" or "single"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvironmentConfigError(
                f"environment variable {name} is not set; expected an integer. "
                "Launch with `lockstep run` (or torchrun, srun, mpirun), which sets it."
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvironmentConfigError(
            f"environment variable {name}={raw!r} is not an integer; "
            f"expected a whole number such as 0. Fix or unset {name}."
        ) from None


def _check(env: LaunchEnv, names: dict[str, str]) -> LaunchEnv:
    """Check the invariants; `names` maps fields to the variable they came from."""
    if env.world_size < 1:
        _bad(names["world_size"], env.world_size, "at least 1")
    if not 0 <= env.rank < env.world_size:
        _bad(
            names["rank"],
            env.rank,
            f"in [0, {env.world_size}) since world size is "
            f"{env.world_size} ({names['world_size']})",
        )
    if env.local_world_size < 1 or env.local_world_size > env.world_size:
        _bad(names["local_world_size"], env.local_world_size, f"in [1, {env.world_size}]")
    if not 0 <= env.local_rank < env.local_world_size:
        _bad(names["local_rank"], env.local_rank, f"in [0, {env.local_world_size})")
    if env.node_rank < 0:
        _bad(names["node_rank"], env.node_rank, "at least 0")
    if not 0 <= env.master_port < 65536:
        _bad("MASTER_PORT", env.master_port, "a TCP port in [0, 65535]")
    return env


def _bad(name: str, value: int, expected: str) -> None:
    raise EnvironmentConfigError(
        f"environment variable {name}={value} is inconsistent: expected {expected}. "
        "Check the launcher command that set it."
    )


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "WORLD_SIZE")
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    return _check(
        LaunchEnv(
            source="torchrun",
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
            master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        ),
        {
            "rank": "RANK",
            "local_rank": "LOCAL_RANK",
            "world_size": "WORLD_SIZE",
            "local_world_size": "LOCAL_WORLD_SIZE",
            "node_rank": "GROUP_RANK",
        },
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "SLURM_NTASKS")
    nnodes = _int(env, "SLURM_NNODES", 1)
    local_world_size = _int(env, "SLURM_NTASKS_PER_NODE", max(1, world_size // nnodes))
    return _check(
        LaunchEnv(
            source="slurm",
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(env, "SLURM_NODEID", 0),
            master_addr=_master_addr(env, multi_node=nnodes > 1, source="Slurm"),
            master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        ),
        {
            "rank": "SLURM_PROCID",
            "local_rank": "SLURM_LOCALID",
            "world_size": "SLURM_NTASKS",
            "local_world_size": "SLURM_NTASKS_PER_NODE",
            "node_rank": "SLURM_NODEID",
        },
    )


def _from_openmpi(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
    return _check(
        LaunchEnv(
            source="openmpi",
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(env, "OMPI_COMM_WORLD_NODE_RANK", 0),
            master_addr=_master_addr(
                env, multi_node=local_world_size < world_size, source="OpenMPI"
            ),
            master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        ),
        {
            "rank": "OMPI_COMM_WORLD_RANK",
            "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "world_size": "OMPI_COMM_WORLD_SIZE",
            "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
            "node_rank": "OMPI_COMM_WORLD_NODE_RANK",
        },
    )


def _master_addr(env: Mapping[str, str], *, multi_node: bool, source: str) -> str:
    addr = env.get("MASTER_ADDR")
    if addr:
        return addr
    if multi_node:
        raise EnvironmentConfigError(
            f"{source} launched a multi-node job but MASTER_ADDR is not set; expected the "
            "address of the node that hosts rank 0. Export MASTER_ADDR (and MASTER_PORT) "
            "in the job script, or start the job with `lockstep run`."
        )
    return DEFAULT_MASTER_ADDR


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Work out rank, world size and friends from launcher variables.

    Args:
        env: the variables to read; `os.environ` when None.

    Returns:
        The frozen `LaunchEnv`. Without any launcher variables, a single process.

    Raises:
        EnvironmentConfigError: a variable is not an integer or the set is inconsistent
            (for example RANK >= WORLD_SIZE); the message names the variable and value.
    """
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env)
    return LaunchEnv("single", 0, 0, 1, 1, 0, DEFAULT_MASTER_ADDR, 0)


def read_timeout(env: Mapping[str, str] | None = None) -> timedelta:
    """Collective timeout: LOCKSTEP_TIMEOUT_S seconds if set, else 5 minutes."""
    env = os.environ if env is None else env
    seconds = _int(env, TIMEOUT_VARIABLE, int(DEFAULT_TIMEOUT.total_seconds()))
    if seconds <= 0:
        _bad(TIMEOUT_VARIABLE, seconds, "a positive number of seconds")
    return timedelta(seconds=seconds)


def read_trace_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Directory for Chrome trace files named by LOCKSTEP_TRACE, or None when unset or empty."""
    env = os.environ if env is None else env
    return env.get(TRACE_VARIABLE) or None


def read_trace_flush_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds between writes of the LOCKSTEP_TRACE file: LOCKSTEP_TRACE_FLUSH_S, else 5."""
    return read_seconds(TRACE_FLUSH_VARIABLE, DEFAULT_TRACE_FLUSH_S, env)


def read_seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Variable `name` as a positive number of seconds, else `default`.

    Raises:
        EnvironmentConfigError: the value is not a positive number.
    """
    env = os.environ if env is None else env
    raw = env.get(name) or str(default)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e6:
        raise EnvironmentConfigError(
            f"environment variable {name}={raw!r} is not a positive number of seconds; "
            f"expected for example {default:g}. Fix or unset it."
        )
    return seconds


def read_variable(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A variable a launcher hands its workers as is (a file or folder path), or None."""
    return (os.environ if env is None else env).get(name) or None


def read_slurm_nodes(env: Mapping[str, str] | None = None) -> dict[str, str | int] | None:
    """Under Slurm, the launcher's node count, node rank, first host and port; else None.

    The port is MASTER_PORT when set, else derived from SLURM_JOB_ID (in [20000, 30000)),
    so every node of the job picks the same one without being told.

    Raises:
        EnvironmentConfigError: srun started more than one task per node (each would
            be a launcher of its own); the message says how to start one per node.
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return None
    _check_one_launcher_per_node(env)
    first_host = env.get("MASTER_ADDR") or _first_host(env.get("SLURM_JOB_NODELIST", ""))
    return {
        "nnodes": _int(env, "SLURM_NNODES"),
        "node_rank": _int(env, "SLURM_NODEID", 0),
        "master_addr": first_host,
        "master_port": _int(env, "MASTER_PORT", 20000 + _int(env, "SLURM_JOB_ID") % 10000),
    }


def _check_one_launcher_per_node(env: Mapping[str, str]) -> None:
    """Inside an srun step, refuse more than one `lockstep run` per node."""
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", 1)
    nodes = _int(env, "SLURM_STEP_NUM_NODES", 1)
    if tasks > nodes:
        raise EnvironmentConfigError(
            f"srun started {tasks} tasks on {nodes} node(s) (SLURM_STEP_NUM_TASKS={tasks}, "
            f"SLURM_STEP_NUM_NODES={nodes}), but `lockstep run` starts the workers itself "
            "and expects one task per node. Use `srun --ntasks-per-node=1 lockstep run "
            "--nproc-per-node N ...` (in sbatch: #SBATCH --ntasks-per-node=1), or run "
            "the script itself under `srun -n N python train.py`."
        )


def read_socket_ifnames(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The interface choices the user made for gloo and NCCL (GLOO_/NCCL_SOCKET_IFNAME)."""
    env = os.environ if env is None else env
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    return {name: env[name] for name in names if env.get(name)}


def _first_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as 'gpu[01-04,07],cpu3' -> 'gpu01'."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix + first
