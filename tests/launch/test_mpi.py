"""Under OpenMPI: `mpirun -np 2 python train.py` trains bitwise like `lockstep run`.

lockstep reads OMPI_COMM_WORLD_RANK and friends (lockstep.env) and forms its gloo
group at MASTER_ADDR:MASTER_PORT (127.0.0.1 and a free port here); MPI itself only
starts the processes. Its own traffic is kept on loopback (btl and oob on `lo`).
As root, mpirun needs --allow-run-as-root. The command is the one
docs/multinode.md shows.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from launchkit import TRAIN, final_params

# A whole mpirun job beside a `lockstep run` reference: make soak (CI), for make test's time.
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(600)]


def mpirun_argv(nproc: int, script: list[str]) -> list[str]:
    """mpirun on this machine only, over loopback, passing MASTER_ADDR and MASTER_PORT."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [
        "mpirun",
        "-np",
        str(nproc),
        *root,
        "--oversubscribe",
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "lo",
        "--mca",
        "oob_tcp_if_include",
        "lo",
        "-x",
        "MASTER_ADDR",
        "-x",
        "MASTER_PORT",
        "-x",
        "PYTHONPATH",
        sys.executable,
        *script,
    ]


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


# Decided before the reference run is made: without mpirun it would be wasted.
@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun not installed; run .ci/install-launchers as root (openmpi-bin)",
)
def test_mpirun_two_processes_train_bitwise_like_lockstep_run(lockstep_run_reference, tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port()}
    env.setdefault("PYTHONPATH", "")
    argv = mpirun_argv(2, [TRAIN, "--out", str(tmp_path), "--steps", "4"])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 restart 0 starts at step 0" in done.stdout
    trained = final_params(tmp_path)
    assert trained.keys() == lockstep_run_reference.keys()
    for name, value in lockstep_run_reference.items():
        assert torch.equal(trained[name], value), name
