"""Trouble in the launchers' store named by its true cause, not as a network failure.

Two hosts (network namespaces) run a real two-node `lockstep run`, a third plays a
host on the same network. Nodes given different secrets must say so on both sides
within seconds, where a value that does not open used to look like a node that
never wrote (and, after the join timeout, like a failed network). Heartbeats
overwritten and deleted in a loop are named as such, not as a failed network, and
no node says that it sent no report itself. Node 0 started again after a SIGKILL
and the surviving node agree on the next round (they used to wait for different
rounds until the join timeout).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from launchkit import (
    MASTER_PORT,
    TRAIN,
    Launcher,
    final_params,
    first_line_to_text,
    node_args,
    wait_all,
    wait_for,
)

pytestmark = [pytest.mark.netns, pytest.mark.slow]
REPORT_S = 10.0


@pytest.mark.timeout(120)
def test_mismatched_secrets_are_named_on_both_nodes_within_10_s(hosts, tmp_path):
    a, b = hosts
    script = [TRAIN, "--out", str(tmp_path / "out"), "--steps", "4"]
    launchers = [
        Launcher(
            [*node_args(a, rank, nproc=1), *script],
            tmp_path / f"node{rank}.log",
            host,
            env={"LOCKSTEP_JOB_SECRET": f"this-is-node-{rank}s-own-secret"},
        )
        for rank, host in enumerate((a, b))
    ]
    said = [f"node {rank}: the job secret differs from node {1 - rank}'s" for rank in (0, 1)]
    took = first_line_to_text(launchers, said, 60)
    codes = wait_all(launchers, 30)
    logs = [launcher.log() for launcher in launchers]
    print(f"mismatched secrets named {took:.1f} s after the last launcher's first line")
    assert took < REPORT_S, f"{took:.1f} s\n" + "\n".join(logs)
    assert codes == [1, 1], logs
    assert not any("network" in log for log in logs), logs


# Runs on the third host; argv: addr port out. Overwrites and deletes the round's keys.
TAMPER = r"""
import json, os, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
addr, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
while not os.path.exists(f"{out}/pids/1.0"):
    time.sleep(0.1)
opened = json.loads(json.loads(store.get("lockstep/lockstep/open"))["v"])  # readable
r0 = f"lockstep/lockstep/{opened['job']}/r0/" if "job" in opened else "lockstep/lockstep/r0/"
rounds, deadline = 0, time.monotonic() + 60
try:
    while time.monotonic() < deadline:
        store.set(r0 + "alive/1", "garbage")
        for name in ("alive/0", "report/0", "report/1"):
            store.delete_key(r0 + name)
        rounds += 1
except Exception:  # the job ended: its store is gone
    pass
print(json.dumps({"rounds": rounds}), flush=True)
"""


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_heartbeats_overwritten_and_deleted_in_a_loop_are_named_not_the_network(hosts3, tmp_path):
    a, b, stranger = hosts3
    out = tmp_path / "out"
    out.mkdir()
    attack = stranger.popen(
        [sys.executable, "-c", TAMPER, a.address, str(MASTER_PORT), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    script = [TRAIN, "--out", str(out), "--steps", "200", "--step-sleep", "0.3"]
    flags = ["--rdzv-timeout", "40"]  # a node unheard for 10 s is lost
    launchers = [
        Launcher([*node_args(a, rank, nproc=1, extra=flags), *script], out / f"n{rank}.log", h)
        for rank, h in enumerate((a, b))
    ]
    codes = wait_all(launchers, 200)
    said, errors = attack.communicate(timeout=60)
    logs = [launcher.log() for launcher in launchers]
    assert json.loads(said.strip().splitlines()[-1])["rounds"] > 0, errors
    assert codes == [1, 1], logs
    assert "was overwritten or deleted" in logs[0], logs[0]  # node 0 lost node 1's beat
    for log in logs:
        assert "the network between" not in log and "unknown cause" not in log, log
    assert "node 0: sent no report" not in logs[0], logs[0]


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_node_0_started_again_and_the_other_node_agree_on_the_next_round(
    hosts, tmp_path, lockstep_run_reference
):
    a, b = hosts
    out = tmp_path / "out"
    out.mkdir()
    script = [TRAIN, "--out", str(out), "--steps", "4", "--step-sleep", "3.0"]
    flags = ["--max-restarts", "2", "--rdzv-timeout", "60"]
    argv = [[*node_args(a, rank, nproc=1, extra=flags), *script] for rank in (0, 1)]
    first = Launcher(argv[0], out / "node0.log", a)
    other = Launcher(argv[1], out / "node1.log", b)
    try:
        wait_for(out / "ckpt", 120, [first, other])  # a checkpoint to resume from
        first.kill()  # SIGKILL: its workers die with it, its store too
        time.sleep(2.0)  # node 1 loses the store, its workers their peer
        again = Launcher(argv[0], out / "node0-again.log", a)
        codes = wait_all([again, other], 200)
    finally:
        first.kill()
        other.kill()
    logs = [again.log(), other.log()]
    assert codes == [0, 0], logs
    assert (out / "restarts.txt").read_text() == "1", logs  # rank 0 counts the job's restart
    resumed = final_params(out)
    for name, value in lockstep_run_reference.items():
        assert torch.equal(resumed[name], value), name
