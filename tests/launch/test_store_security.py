"""The job's stores are its own: loopback only on one node, sealed values on several.

Hosts sit on one switch (`lan`): the job runs on the first one or two, and the last
one plays a stranger on the same network. On one node nothing of the job may be
reachable from there; on two nodes the stranger reaches the store (torch's
TCPStore has no authentication) and reads, forges failure reports, bumps the
report count and plants pickles while the job trains, and the job must finish
bitwise equal to an undisturbed run, with no pickle ever loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launchkit import MASTER_PORT, TRAIN, Launcher, final_params, node_args, wait_all, wait_for

from lockstep.testing.netns import Host

pytestmark = [pytest.mark.netns, pytest.mark.slow]
STEPS = 4  # as the session's `lockstep_run_reference`

# Runs in the stranger's namespace; argv: addr port out. Prints a JSON summary at the end.
STRANGER = r"""
import json, os, pickle, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
addr, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Plant:
    def __reduce__(self):
        return (os.system, (f"touch {out}/pwned",))

done = {"connected": False, "read": None, "rounds": 0}
store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
done["connected"] = True
while not os.path.exists(f"{out}/pids/1.0"):  # the workers run: attack now
    time.sleep(0.1)
opened = json.loads(json.loads(store.get("lockstep/lockstep/open"))["v"])  # readable, not secret
r0 = f"lockstep/lockstep/{opened['job']}/r0/" if "job" in opened else "lockstep/lockstep/r0/"
if store.check([r0 + "node/1"]):
    done["read"] = store.get(r0 + "node/1").decode()
forged = json.dumps({"v": json.dumps({"node_rank": 1, "host": "x", "addr": "x",
    "cause": "forged", "failures": [], "final": True}), "mac": "0" * 64})
pickled = pickle.dumps(Plant())
deadline = time.monotonic() + 120
while not os.path.exists(f"{out}/final.pt") and time.monotonic() < deadline:
    for node in (0, 1):
        store.set(f"{r0}report/{node}", forged)
        store.set(f"{r0}alive/{node}", pickled)
    store.add(f"{r0}reports", 1)
    store.set(f"{r0}abort", pickled)
    store.set("torch.rendezvous.lockstep", pickled)  # torch's c10d rendezvous state
    store.add("torch.rendezvous.lockstep.0/lockstep/reports", 1)  # its round-0 report count
    done["rounds"] += 1
    time.sleep(0.2)
print(json.dumps(done), flush=True)
"""


# Runs in the stranger's namespace; argv: addr port out limit_mib. 1 MiB values, new keys.
FLOOD = r"""
import json, os, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
addr, port, out, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
while not os.path.exists(f"{out}/pids/1.0"):  # the workers run: flood now
    time.sleep(0.1)
value, sent = os.urandom(1 << 20), 0
try:
    while sent < limit:
        store.set(f"flood/{sent}", value)
        sent += 1
except Exception:  # the store is gone
    pass
print(json.dumps({"sent_mib": sent}), flush=True)
"""


def _resident_mib(pid: int) -> int:
    """VmRSS of `pid` in MiB (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(found[0]) >> 10 if found else 0  # a zombie has none


def _listeners(host: Host) -> list[str]:
    """Local address:port of every listening TCP socket in the host's namespace."""
    out = host.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines()]


def _watch_listeners(hosts: list[Host], launchers: list[Launcher]) -> set[str]:
    """Every listening address seen in the hosts' namespaces until the launchers end."""
    seen: set[str] = set()
    while any(launcher.proc.poll() is None for launcher in launchers):
        for host in hosts:
            seen |= set(_listeners(host))
        time.sleep(0.2)
    return seen


def _reachable(stranger: Host, target: Host, ports: list[int]) -> list[int]:
    """Which of `ports` on `target`'s address accept a TCP connection from the stranger."""
    code = (
        "import json, socket, sys\n"
        "ok = []\n"
        "for port in json.loads(sys.argv[2]):\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1], port), timeout=2).close()\n"
        "        ok.append(port)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(json.dumps(ok))\n"
    )
    argv = [sys.executable, "-c", code, target.address, json.dumps(ports)]
    done = stranger.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.soak
def test_one_node_listens_on_loopback_only(hosts3, tmp_path):
    node, stranger = hosts3[0], hosts3[2]
    argv = ["--nproc-per-node", "2", TRAIN, "--out", str(tmp_path), "--steps", "6"]
    launcher = Launcher([*argv, "--step-sleep", "0.3"], tmp_path / "launcher.log", node)
    wait_for(tmp_path / "pids" / "1.0", 120, [launcher])
    seen = set(_listeners(node))
    ports = sorted({int(entry.rsplit(":", 1)[1]) for entry in seen})
    open_to_stranger = _reachable(stranger, node, ports)
    seen |= _watch_listeners([node], [launcher])
    assert launcher.wait(timeout=120) == 0, launcher.log()
    # launcher's store, workers' store, gloo's pairs: at least 4 sockets, all on loopback
    assert len(seen) >= 4, seen
    assert all(entry.startswith("127.0.0.1:") for entry in seen), seen
    assert open_to_stranger == [], f"reachable from another host: {open_to_stranger}"


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stranger_can_neither_stop_nor_steer_two_nodes(hosts3, tmp_path, lockstep_run_reference):
    a, b, stranger = hosts3
    out = tmp_path / "run"
    out.mkdir()
    attack = stranger.popen(
        [sys.executable, "-c", STRANGER, a.address, str(MASTER_PORT), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    script = [TRAIN, "--out", str(out), "--steps", str(STEPS), "--step-sleep", "1.0"]
    launchers = [
        Launcher([*node_args(a, rank, nproc=1), *script], out / f"node{rank}.log", host)
        for rank, host in enumerate((a, b))
    ]
    seen = _watch_listeners([a, b], launchers)
    codes = wait_all(launchers, 150)
    report, errors = attack.communicate(timeout=30)
    logs = "\n".join(launcher.log() for launcher in launchers)
    assert not (out / "pwned").exists(), "a pickle from the store was loaded"
    assert codes == [0, 0], logs
    assert report.strip(), errors
    done = json.loads(report.strip().splitlines()[-1])
    assert done["connected"] and done["rounds"] > 0, done  # it did reach the store and act
    assert done["read"] and "lockstep-tests-job-secret" not in done["read"]  # no secret in it
    assert not (out / "pwned").exists(), "a pickle from the store was loaded"
    assert "restart 1" not in logs and "): forged" not in logs
    assert "values not sealed for this job keep appearing" in logs  # and they are named
    # The job listens on its hosts' own addresses (and loopback), never on all interfaces.
    local = {a.address, b.address, "127.0.0.1"}
    assert all(entry.rsplit(":", 1)[0] in local for entry in seen), seen
    resumed = final_params(out)
    for name, value in lockstep_run_reference.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flood_of_keys_is_named_and_ends_the_job_before_node_0_runs_out(hosts3, tmp_path):
    a, b, stranger = hosts3
    out = tmp_path / "run"
    out.mkdir()
    limit = 1500  # MiB; the bound on node 0's launcher is 512 MiB of growth
    flood = stranger.popen(
        [sys.executable, "-c", FLOOD, a.address, str(MASTER_PORT), str(out), str(limit)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    script = [TRAIN, "--out", str(out), "--steps", "200", "--step-sleep", "0.3"]
    launchers = [
        Launcher([*node_args(a, rank, nproc=1), *script], out / f"node{rank}.log", host)
        for rank, host in enumerate((a, b))
    ]
    wait_for(out / "pids" / "1.0", 120, launchers)
    base = peak = _resident_mib(launchers[0].proc.pid)
    deadline = time.monotonic() + 150
    while launchers[0].proc.poll() is None and time.monotonic() < deadline:
        peak = max(peak, _resident_mib(launchers[0].proc.pid))
        time.sleep(0.05)
    codes = wait_all(launchers, 60)
    said, errors = flood.communicate(timeout=60)
    logs = [launcher.log() for launcher in launchers]
    sent = json.loads(said.strip().splitlines()[-1])["sent_mib"] if said.strip() else errors
    print(f"node 0's launcher grew by {peak - base} MiB; the stranger sent {sent} MiB")
    assert codes == [1, 1], logs
    assert "node 0's stores are flooded" in logs[0], logs[0]
    # Node 1 reads node 0's report if the flooded store lets it in time, else says where to look.
    assert "node 0's stores are flooded" in logs[1] or "check node 0's log" in logs[1], logs[1]
    assert peak - base < 1024, f"grew by {peak - base} MiB"
    assert isinstance(sent, int) and sent < limit, sent  # cut off when node 0 ended
