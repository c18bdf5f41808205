"""Pre-flight: a node that cannot take part fails in seconds, naming itself, the address and port.

Every case is a real launcher in a network namespace; they run side by side and
each must fail with exit code 1 and a message that says what to check.
"""

from __future__ import annotations

import sys
import time

import pytest
from launchkit import MASTER_PORT, TRAIN, Launcher, node_args, wait_all

pytestmark = pytest.mark.netns


def test_preflight_failures_are_plain_messages(hosts, tmp_path):
    a, b = hosts
    # Something else holds the master port on host a.
    holder = a.popen(
        [sys.executable, "-c", "import socket, time\n"
         f"s = socket.create_server(('{a.address}', {MASTER_PORT})); time.sleep(300)"],
    )  # fmt: skip
    try:
        time.sleep(0.5)
        script = [TRAIN, "--out", str(tmp_path)]
        silent = [*node_args(a, 1), "--rdzv-timeout", "3"]
        cases = {
            # node 1 whose master never comes up (and whose user chose gloo's interface)
            "no_master": (b, [*silent, "--master-port", str(MASTER_PORT + 1), *script]),
            # node 1 whose master port is held by a program that never answers
            "not_a_store": (b, [*silent, *script]),
            # node 0 started on the wrong machine
            "not_mine": (b, [*node_args(a, 0), *script]),
            # node 0 whose port is taken
            "port_taken": (a, [*node_args(a, 0), *script]),
            # a master name that does not resolve
            "no_name": (b, ["--nnodes", "2", "--node-rank", "1", "--master-port", "1",
                            "--master-addr", "no-such-host.invalid", *script]),
            # a node that would advertise loopback to the others
            "loopback": (b, [*node_args(a, 1), "--local-addr", "127.0.0.1", *script]),
        }  # fmt: skip
        chosen = {"GLOO_SOCKET_IFNAME": "lo"}
        launchers = {
            name: Launcher(
                argv, tmp_path / f"{name}.log", host, chosen if name == "no_master" else None
            )
            for name, (host, argv) in cases.items()
        }
        codes = wait_all(list(launchers.values()), 120)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    logs = {name: launcher.log() for name, launcher in launchers.items()}
    assert codes == [1] * len(cases), logs
    port = f"{a.address}:{MASTER_PORT + 1}"
    assert f"node 1 cannot reach the master at {port}" in logs["no_master"]
    assert "Connection refused" in logs["no_master"]
    assert (
        f"the rendezvous store at {a.address}:{MASTER_PORT} does not answer"
        in (logs["not_a_store"])
    )
    assert "firewall" in logs["no_master"]
    assert "interface as set: GLOO_SOCKET_IFNAME=lo" in logs["no_master"]  # honoured, logged
    assert f"address {a.address}, interface {a.interface} (GLOO" in logs["port_taken"]
    assert (
        f"the master address {a.address} ({a.address}) is not an address of this machine"
        in (logs["not_mine"])
    )
    assert (
        f"port {MASTER_PORT} on {a.address} ({a.address}) is already in use" in (logs["port_taken"])
    )
    assert "node 1 cannot resolve the master address 'no-such-host.invalid'" in logs["no_name"]
    assert "node 1 would be reached at the loopback address 127.0.0.1" in logs["loopback"]
    for log in logs.values():
        assert "Traceback" not in log
    assert not list(tmp_path.glob("pids/*")), "no worker should have started"
