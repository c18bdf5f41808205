"""A single-node Slurm cluster for the launcher tests: munged, slurmctld and slurmd as root.

Everything lives in one temporary directory (configuration, munge key and socket,
state, logs) and talks over loopback only: the controller and the node are
`localhost` at 127.0.0.1, on ports picked free at start. The daemons run in the
foreground as children of the test process, so teardown stops exactly them.
Needs root and Debian's slurm-wlm and munge (`.ci/install-launchers` installs them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
START_TIMEOUT_S = 60

SLURM_CONF = """\
ClusterName=lockstep-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class SlurmUnavailable(RuntimeError):
    """The cluster cannot be started here; the message says why."""


def unavailable_reason() -> str | None:
    """Why a cluster cannot be started (not root, a program missing), or None."""
    if os.geteuid() != 0:
        return f"the test cluster runs its daemons as root (this is uid {os.geteuid()})"
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed; run .ci/install-launchers as root "
            "(apt-get install slurm-wlm munge)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_config(root: Path) -> Path:
    root.chmod(0o711)  # munged wants its socket's directory closed to writers
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port()))
    return conf


def _daemons(root: Path) -> list[list[str]]:
    munged = [
        "munged",
        "--foreground",
        "--force",
        f"--key-file={root}/munge.key",
        f"--socket={root}/munge.sock",
        f"--pid-file={root}/munged.pid",
        f"--log-file={root}/munged.log",
        f"--seed-file={root}/munged.seed",
        "--origin=127.0.0.1",
    ]
    return [munged, ["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", "localhost"]]


def _wait_idle(env: dict[str, str], procs: list[subprocess.Popen], root: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            break
        done = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=20
        )
        state = done.stdout.strip() or done.stderr.strip()
        if state == "idle":
            return
        time.sleep(0.3)
    logs = "\n".join(
        f"{name}: {(root / name).read_text(errors='replace')[-600:]}"
        for name in ("munged.log", "slurmctld.log", "slurmd.log")
        if (root / name).exists()
    )
    raise SlurmUnavailable(f"the node did not become idle (sinfo: {state!r}):\n{logs}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


@contextmanager
def single_node_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd under `root`; yields the environment for srun.

    Raises:
        SlurmUnavailable: not root, programs missing, or the node never became idle.
    """
    reason = unavailable_reason()
    if reason:
        raise SlurmUnavailable(reason)
    env = {**os.environ, "SLURM_CONF": str(_write_config(root))}
    procs: list[subprocess.Popen] = []
    try:
        for argv in _daemons(root):
            with open(root / f"{argv[0]}.out", "w") as sink:
                procs.append(subprocess.Popen(argv, env=env, stdout=sink, stderr=sink))
            if argv[0] == "munged":
                _wait_for(root / "munge.sock", procs)
        _wait_idle(env, procs, root)
        yield env
    finally:
        _stop(procs)


def _wait_for(path: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline or procs[-1].poll() is not None:
            raise SlurmUnavailable(f"{path} did not appear (munged exited or is slow)")
        time.sleep(0.1)
