"""Under a real Slurm: `srun -n 2 python train.py` and an sbatch job running `srun lockstep run`.

A single-node cluster (munged, slurmctld, slurmd; tests/launch/slurmkit.py) is
started once for this module, on loopback only, and stopped afterwards. Both
jobs train tests/launch/train_tiny.py and must end with parameters bitwise equal
to `lockstep run --nproc-per-node 2` (the `lockstep_run_reference` fixture).
The sbatch script is the one docs/multinode.md shows.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launchkit import TRAIN, final_params
from slurmkit import SlurmUnavailable, single_node_cluster

# Generous bounds: each job imports torch in every process, on a machine that may be loaded.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = "4"
SBATCH_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=lockstep-test
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1        # one launcher per node; it starts the workers
#SBATCH --cpus-per-task=2
#SBATCH --time=00:05:00
#SBATCH --output={out}/job.log

srun lockstep run --nproc-per-node 2 {train} --out {out} --steps {steps}
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF, PATH with this Python's bin first) for srun and sbatch."""
    root = tmp_path_factory.mktemp("slurm")
    cluster = single_node_cluster(root)
    try:
        env = cluster.__enter__()
    except SlurmUnavailable as error:
        pytest.skip(f"no Slurm cluster: {error}")
    try:
        bin_dir = str(Path(sys.executable).parent)
        yield {**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}", "MASTER_PORT": _free_port()}
    finally:
        cluster.__exit__(None, None, None)


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _assert_bitwise(out: Path, reference: dict[str, torch.Tensor]) -> None:
    trained = final_params(out)
    assert trained.keys() == reference.keys()
    for name in reference:
        assert torch.equal(trained[name], reference[name]), name


def _reference(request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    """The session's `lockstep run` reference, built only once `slurm` has not skipped
    (pytest sets session fixtures up before module ones, whatever the argument order)."""
    return request.getfixturevalue("lockstep_run_reference")


@pytest.mark.soak  # a whole srun job beside a reference: make soak (CI), for make test's time
def test_srun_two_tasks_train_bitwise_like_lockstep_run(slurm, request, tmp_path):
    argv = ["srun", "-n", "2", "--time=5", "python", TRAIN, "--out", str(tmp_path)]
    done = subprocess.run(
        [*argv, "--steps", STEPS], env=slurm, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 restart 0 starts at step 0" in done.stdout
    _assert_bitwise(tmp_path, _reference(request))


@pytest.mark.soak
def test_sbatch_srun_lockstep_run_trains_bitwise_like_lockstep_run(slurm, request, tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(SBATCH_SCRIPT.format(out=tmp_path, train=TRAIN, steps=STEPS))
    done = subprocess.run(
        ["sbatch", "--wait", str(script)], env=slurm, capture_output=True, text=True, timeout=300
    )
    log = (
        (tmp_path / "job.log").read_text(errors="replace")
        if os.path.exists(tmp_path / "job.log")
        else ""
    )
    assert done.returncode == 0, done.stdout + done.stderr + log
    assert "node 0 of 1" in log and "ranks 0-1 of 2" in log, log
    _assert_bitwise(tmp_path, _reference(request))
