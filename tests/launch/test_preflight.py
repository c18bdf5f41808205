"""Pre-flight: a node that cannot take part fails in seconds, naming itself, the address and port.

Every case runs the launcher in a network namespace and must end with exit code 1
and a message that says what to check. The cases that fail before any store is
touched share one process (`lockstep.cli.main` called once per case) to spare
the start-up cost; the two that need a process of their own get one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from launchkit import JOB_SECRET, MASTER_PORT, TRAIN, Launcher, node_args, wait_all

pytestmark = [pytest.mark.netns, pytest.mark.slow]
RUN_CASES = (
    "import json, sys\n"
    "from lockstep import cli\n"
    "for name, argv in json.loads(sys.argv[1]).items():\n"
    "    print(f'=== {name}', file=sys.stderr, flush=True)\n"
    "    print(f'=== exit {cli.main([\"run\", *argv])}', file=sys.stderr, flush=True)\n"
)


def _split(log: str) -> dict[str, str]:
    """The shared process's log, cut into one text per case."""
    cases, name = {}, None
    for line in log.splitlines():
        if line.startswith("=== ") and not line.startswith("=== exit"):
            name = line[4:]
            cases[name] = ""
        elif name is not None:
            cases[name] += line + "\n"
    return cases


def _shared_cases(a, b, tmp_path) -> dict[str, list[str]]:
    script = [TRAIN, "--out", str(tmp_path)]
    return {
        # node 1 whose master never comes up
        "no_master": [
            *node_args(a, 1),
            "--rdzv-timeout",
            "3",
            "--master-port",
            str(MASTER_PORT + 1),
            *script,
        ],
        # node 0 started on the wrong machine
        "not_mine": [*node_args(a, 0), *script],
        # a master name that does not resolve
        "no_name": [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            "1",
            "--master-addr",
            "no-such-host.invalid",
            *script,
        ],
        # a node that would advertise loopback to the others
        "loopback": [*node_args(a, 1), "--local-addr", "127.0.0.1", *script],
    }


def test_preflight_failures_are_plain_messages(hosts, tmp_path):
    a, b = hosts
    holder = a.popen(  # a program that holds the master port on host a and never answers
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            f"s = socket.create_server(('{a.address}', {MASTER_PORT})); time.sleep(300)",
        ],
    )
    try:
        time.sleep(0.5)
        cases = _shared_cases(a, b, tmp_path)
        shared = b.popen(
            [sys.executable, "-c", RUN_CASES, json.dumps(cases)],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "LOCKSTEP_JOB_SECRET": JOB_SECRET},
        )
        script = [TRAIN, "--out", str(tmp_path)]
        own = {  # node 1 facing the silent program; node 0 whose port it holds
            "not_a_store": Launcher(
                [*node_args(a, 1), "--rdzv-timeout", "3", *script], tmp_path / "s.log", b
            ),
            "port_taken": Launcher([*node_args(a, 0), *script], tmp_path / "p.log", a),
        }
        logs = _split(shared.communicate(timeout=120)[1])
        codes = wait_all(list(own.values()), 120)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    logs.update({name: launcher.log() for name, launcher in own.items()})
    assert codes == [1, 1], logs
    assert [logs[name].rstrip().endswith("=== exit 1") for name in cases] == [True] * len(cases)
    _check_messages(a, b, logs)
    assert not list(tmp_path.glob("pids/*")), "no worker should have started"


def _check_messages(a, b, logs: dict[str, str]) -> None:
    refused = f"node 1 cannot reach the master at {a.address}:{MASTER_PORT + 1}"
    assert refused in logs["no_master"]
    assert "Connection refused" in logs["no_master"] and "firewall" in logs["no_master"]
    honoured = f"interface {b.interface} (NCCL_SOCKET_IFNAME); GLOO_SOCKET_IFNAME=lo as set"
    assert honoured in logs["no_master"]  # the user's choice kept, the other one filled in
    silent = f"the rendezvous store at {a.address}:{MASTER_PORT} does not answer"
    assert silent in logs["not_a_store"]
    foreign = f"master address {a.address} ({a.address}) is not an address of this machine"
    assert foreign in logs["not_mine"]
    taken = f"port {MASTER_PORT} on {a.address} ({a.address}) is already in use"
    assert taken in logs["port_taken"]
    assert f"address {a.address}, interface {a.interface} (GLOO" in logs["port_taken"]
    unknown = "node 1 cannot resolve the master address 'no-such-host.invalid'"
    assert unknown in logs["no_name"]
    assert "node 1 would be reached at the loopback address 127.0.0.1" in logs["loopback"]
    for text in logs.values():
        assert "Traceback" not in text
