"""Two nodes on one machine (network namespaces): training, failover, a lost node, the traffic.

Node 0 runs in namespace a, node 1 in namespace b; they reach each other only
over the veth pair. The uninterrupted two-node run (world size 4) is the
reference: a single-node world-size-4 run and a run whose worker is SIGKILLed
mid-training must both end with bitwise the same parameters.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import time

import pytest
import torch
from launchkit import TRAIN, Launcher, final_params, live_workers, two_nodes, wait_all, wait_for

from lockstep.testing.netns import Host, two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]  # own waits: 240 s
STEPS = 6
PARAM_BYTES = 4 * (6 * 16 + 16 + 16 + 1)  # train_tiny.py's model, float32


def _connections(host: Host) -> set[tuple[str, str]]:
    """(local, peer) addresses of the TCP connections open in the host's namespace."""
    out = host.run(["ss", "-Htn"], capture_output=True, text=True, check=True).stdout
    pairs = set()
    for line in out.splitlines():
        fields = line.split()
        ends = [f.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for f in fields[3:5]]
        pairs.add((ends[0], ends[1]))
    return pairs


@pytest.fixture(scope="module")
def reference(netns_ready, tmp_path_factory):
    """An uninterrupted two-node run; also the connections seen and the bytes on the link."""
    out = tmp_path_factory.mktemp("two_nodes")
    with two_hosts() as (a, b):
        before = [host.counters() for host in (a, b)]
        script = ["--out", str(out), "--steps", str(STEPS), "--step-sleep", "0.3"]
        launchers = two_nodes(a, b, out, [], script)
        wait_for(out / "pids" / "3.0", 150, launchers)
        seen: set[tuple[str, str]] = set()
        while any(launcher.proc.poll() is None for launcher in launchers):
            seen |= _connections(a) | _connections(b)
            time.sleep(0.2)
        codes = wait_all(launchers, 150)
        sent = [
            host.counters().tx_bytes - then.tx_bytes
            for host, then in zip((a, b), before, strict=True)
        ]
        logs = [launcher.log() for launcher in launchers]
        assert codes == [0, 0], "\n".join(logs)
        return {"out": out, "hosts": (a, b), "seen": seen, "sent": sent, "logs": logs}


def test_two_nodes_match_one_node_bitwise(reference, tmp_path):
    launcher = Launcher(
        ["--nproc-per-node", "4", TRAIN, "--out", str(tmp_path), "--steps", str(STEPS)],
        tmp_path / "launcher.log",
    )
    assert launcher.wait(timeout=150) == 0, launcher.log()
    one_node, two_node = final_params(tmp_path), final_params(reference["out"])
    assert one_node.keys() == two_node.keys()
    for name in one_node:
        assert torch.equal(one_node[name], two_node[name]), name


def test_traffic_stays_on_the_namespace_addresses(reference):
    a, b = reference["hosts"]
    subnet = ipaddress.ip_network(f"{a.address}/24", strict=False)
    assert reference["seen"], "no TCP connection was seen while training ran"
    strays = {
        pair
        for pair in reference["seen"]
        if not all(ipaddress.ip_address(ip) in subnet for ip in pair)
    }
    assert not strays, f"connections outside {subnet}: {strays}"
    # Every step all-reduces the gradients across the link, in both directions.
    assert min(reference["sent"]) >= STEPS * PARAM_BYTES
    for host, log in zip((a, b), reference["logs"], strict=True):
        assert f"address {host.address}, interface {host.interface}" in log


@pytest.mark.soak
def test_sigkill_of_one_worker_restarts_every_node_and_resumes_bitwise(reference, hosts, tmp_path):
    a, b = hosts
    script = ["--out", str(tmp_path), "--steps", str(STEPS), "--kill-rank", "3", "--kill-step", "3"]
    launchers = two_nodes(a, b, tmp_path, ["--max-restarts", "1"], script)
    codes = wait_all(launchers, 240)
    logs = [launcher.log() for launcher in launchers]
    assert codes == [0, 0], "\n".join(logs)
    for log in logs:  # both nodes name the cause and restart together
        assert "restart 1 of 1: rank 3 (node 1" in log
        assert "killed by signal SIGKILL" in log
    assert (tmp_path / "restarts.txt").read_text() == "1"
    resumed, uninterrupted = final_params(tmp_path), final_params(reference["out"])
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), name


@pytest.mark.soak
def test_killing_node1_launcher_makes_node0_report_and_exit(hosts, tmp_path):
    a, b = hosts
    script = ["--out", str(tmp_path), "--steps", "100000", "--step-sleep", "0.05"]
    flags = ["--max-restarts", "1", "--rdzv-timeout", "10", "--nproc-per-node", "1"]
    node0, node1 = two_nodes(a, b, tmp_path, flags, script)
    wait_for(tmp_path / "pids" / "1.0", 150, [node0, node1])
    node1.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert node0.wait(timeout=90) == 1
    took = time.monotonic() - killed
    log = node0.log()
    assert "did not all join the rendezvous" in log
    assert f"node 1 ({socket.gethostname()}, {b.address}) sent no report" in log
    assert took < 60, f"node 0 took {took:.0f} s to give up"
    deadline = time.monotonic() + 10  # node 1's workers die with their launcher
    while _running(a) + _running(b) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(a) + _running(b) == []
    assert live_workers(tmp_path) == []


def _running(host: Host) -> list[str]:
    """Pids of the processes still inside the host's namespace."""
    argv = ["ip", "netns", "pids", host.namespace]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.soak
def test_a_frozen_node_is_declared_lost_by_its_heartbeat(hosts, tmp_path):
    """Node 1 stops (SIGSTOP: no crash, no closed socket); node 0 must notice and end."""
    a, b = hosts
    script = ["--out", str(tmp_path), "--steps", "100000", "--step-sleep", "0.05"]
    flags = ["--rdzv-timeout", "10", "--nproc-per-node", "1"]
    node0, node1 = two_nodes(a, b, tmp_path, flags, script)
    wait_for(tmp_path / "pids" / "1.0", 150, [node0, node1])
    for pid in _running(b):
        os.kill(int(pid), signal.SIGSTOP)
    assert node0.wait(timeout=90) == 1
    log = node0.log()
    assert "lost node 1: no heartbeat for 10 s" in log
    assert "node 1: sent no report" in log
    node1.kill()  # the frozen node; its worker dies with it
