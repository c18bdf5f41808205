"""Fixtures for the launcher tests: two hosts on this machine (network namespaces) when possible.

The setup installs iproute2 when it is missing and we are root; tests that need
namespaces skip, with the reason printed, only where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from lockstep.testing.netns import NetnsUnavailable, lan, two_hosts, unavailable_reason


def _install_iproute2() -> None:
    """apt-get install iproute2 when `ip` or `tc` is missing and we may (root, apt-get)."""
    if shutil.which("ip") and shutil.which("tc"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (
        ["apt-get", "install", "-y", "-q", "iproute2"],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "iproute2"],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, timeout=300, check=False)
        if argv[1] == "install" and done.returncode == 0:
            return


@pytest.fixture(scope="session")
def netns_ready() -> None:
    """Skip (with the reason) where namespaces cannot be made; install iproute2 if needed."""
    _install_iproute2()
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")


@pytest.fixture
def hosts(netns_ready):
    """Two hosts joined by a veth pair; torn down, with anything left inside, afterwards."""
    pair = two_hosts()
    try:
        a, b = pair.__enter__()
    except NetnsUnavailable as error:
        pytest.skip(f"network namespaces unavailable: {error}")
    try:
        yield a, b
    finally:
        pair.__exit__(None, None, None)


@pytest.fixture
def hosts3(netns_ready):
    """Three hosts on one switch: the job runs on the first two, the third plays a stranger."""
    try:
        with lan(3) as hosts:
            yield hosts
    except NetnsUnavailable as error:
        pytest.skip(f"network namespaces unavailable: {error}")


@pytest.fixture(scope="session")
def lockstep_run_reference(tmp_path_factory):
    """train_tiny.py under `lockstep run --nproc-per-node 2`: what other launchers must match."""
    from launchkit import TRAIN, Launcher, final_params

    out = tmp_path_factory.mktemp("lockstep_run_reference")
    argv = ["--nproc-per-node", "2", TRAIN, "--out", str(out), "--steps", "4"]
    launcher = Launcher(argv, out / "launcher.log")
    assert launcher.wait(timeout=150) == 0, launcher.log()
    return final_params(out)
