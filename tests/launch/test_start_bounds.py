"""A round that formed but whose workers never reach the first step ends, bounded and named.

Two hosts (network namespaces) run a real two-node `lockstep run`. The round forms,
but node 1's worker never joins the job's process group (it is busy before
`lockstep.init()`; a worker that cannot reach the worker store looks the same to its
peers). Node 0's worker used to wait in silence until torch's store raised, naming
a key; now it warns every LOCKSTEP_STALL_WARN_S, naming the rank that has not
arrived, and at LOCKSTEP_TIMEOUT_S raises naming it and the store, so both launchers
end within the bound, saying what they waited for.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
from launchkit import TRAIN, Launcher, node_args, wait_all

from lockstep.env import LaunchEnv

JOIN_S = 15
WARN_S = 5


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.soak  # two nodes and a 15 s bound: make soak
@pytest.mark.timeout(240)
def test_workers_that_never_meet_end_both_launchers_within_the_bound_naming_the_wait(
    hosts, tmp_path
):
    a, b = hosts
    script = [TRAIN, "--out", str(tmp_path / "out"), "--steps", "4"]
    script += ["--late-rank", "1", "--late-s", "600"]
    env = {"LOCKSTEP_TIMEOUT_S": str(JOIN_S), "LOCKSTEP_STALL_WARN_S": str(WARN_S)}
    started = time.monotonic()
    launchers = [
        Launcher([*node_args(a, rank, nproc=1), *script], tmp_path / f"node{rank}.log", h, env)
        for rank, h in enumerate((a, b))
    ]
    codes = wait_all(launchers, 180)
    took = time.monotonic() - started
    logs = [launcher.log() for launcher in launchers]
    joined = "\n".join(logs)
    assert codes[0] != 0 and codes[1] != 0, joined
    assert "[rank 0]: waited 5 s to join the job's process group (2 ranks" in logs[0], joined
    assert "rank(s) [1] have not arrived yet" in logs[0], joined
    named = (
        f"rank 0 waited {JOIN_S} s (LOCKSTEP_TIMEOUT_S) to join the job's process group of 2 "
        "ranks through the store at"
    )
    for log in logs:  # node 1 names node 0's failure as its cause
        assert named in log and "rank(s) [1] never arrived" in log, joined
    # the bound, the start of two launchers and the report's exchange; not torch's 300 s
    assert took < JOIN_S + 90, f"{took:.0f} s\n{joined}"


@pytest.mark.slow  # waits out its bound
@pytest.mark.timeout(60)
def test_a_store_that_cannot_be_reached_is_named_within_the_bound(monkeypatch):
    """A worker whose launcher's store does not answer (a firewall between the nodes, or
    an address of another job) ends at LOCKSTEP_TIMEOUT_S naming the store."""
    from lockstep.arrivals import Arrivals, JoinError

    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    launch = LaunchEnv("torchrun", 1, 0, 2, 1, 1, "127.0.0.1", port)
    started = time.monotonic()
    with pytest.raises(JoinError) as raised:
        Arrivals.post(launch, timedelta(seconds=3))
    assert time.monotonic() - started < 3 + 10
    assert f"rank 1 could not reach the job's store at 127.0.0.1:{port} within 3 s" in str(
        raised.value
    )
