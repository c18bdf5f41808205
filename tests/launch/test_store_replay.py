"""Values sealed in an earlier job, replayed into a later one that shares its secret, are ignored.

Three hosts on one switch: the jobs run on the first two, the third records what
it reads in an earlier job's store (a failure report, the heartbeats, the round
node 0 opened, its confirmation) and writes those sealed values into the next
job's store. One secret for both jobs is what a `--secret-file` on a shared file
system invites. Each replay used to steer the later job (a restart blaming the
earlier job's rank, a node declared lost, node 1 dialing the earlier job's worker
store); now the later job must finish bitwise as if nothing had been written.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launchkit import MASTER_PORT, TRAIN, Launcher, final_params, node_args, wait_all

from lockstep.testing.netns import NetnsUnavailable, lan

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.soak]
STEPS = 4  # as the session's `lockstep_run_reference`
FLAGS = ["--rdzv-timeout", "40"]  # a node unheard for max(10 s, 40 s / 4) is lost

# Runs on the third host; argv: addr port record. Prints the job's prefix.
STORE = r"""
import json, time
from datetime import timedelta
from torch.distributed import TCPStore

def ready(path):  # torch is imported: the launchers may start now
    open(path, "w").close()

def connect(addr, port, wait_s):
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

def read(store, key):
    return store.get(key).decode() if store.check([key]) else None

def prefix(store):  # the open round's keys: readable by anyone, only sealed
    opened = json.loads(json.loads(read(store, "lockstep/lockstep/open"))["v"])
    job = f"{opened['job']}/" if "job" in opened else ""
    return f"lockstep/lockstep/{job}r{opened['round']}/"
"""

# Records the earlier job's sealed values until its store goes away.
RECORD = (
    STORE
    + r"""
import sys
addr, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ready(path + ".ready")
names = ["node/0", "node/1", "start", "report/0", "report/1", "alive/0", "alive/1"]
store = connect(addr, port, 120)
ready(path + ".connected")
record = {}
try:
    while True:
        if store.check(["lockstep/lockstep/open"]):
            record["open"] = read(store, "lockstep/lockstep/open")
            here = prefix(store)
            record["prefix"] = here
            for name in names:
                value = read(store, here + name)
                if value is not None:
                    record[name] = value  # the latest: heartbeats only grow
        json.dump(record, open(path, "w"))
        time.sleep(0.1)
except Exception:  # the store went away with the job
    pass
print(json.dumps(sorted(record)), flush=True)
"""
)

# Writes the recorded values into the later job's store; argv: addr port record what out.
REPLAY = (
    STORE
    + r"""
import os, sys
addr, port, path, what, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
record = json.load(open(path))
ready(path + ".ready")
store = connect(addr, port, 120)
if what == "open":  # before node 1 reads it: the earlier round, and its confirmation
    until = time.monotonic() + 8
    while time.monotonic() < until:
        ready(path + ".connected")  # node 1 starts now
        store.set("lockstep/lockstep/open", record["open"])
        for name in ("node/0", "start"):  # there is no "start" in a job before the nonces
            if name in record:
                store.set(record["prefix"] + name, record[name])
else:
    ready(path + ".connected")
    while not os.path.exists(f"{out}/pids/1.0"):  # the workers run
        time.sleep(0.1)
    here = prefix(store)
    names = ["report/1"] if what == "report" else ["alive/0", "alive/1"]
    until = time.monotonic() + (0 if what == "report" else 2)  # read before the next beat
    while True:
        for name in names:
            store.set(here + name, record[name])
        if time.monotonic() >= until:
            break
        time.sleep(0.05)
print(json.dumps({"replayed": what}), flush=True)
"""
)


@pytest.fixture(scope="module")
def hosts3m(netns_ready):
    try:
        with lan(3) as hosts:
            yield hosts
    except NetnsUnavailable as error:
        pytest.skip(f"network namespaces unavailable: {error}")


def _job(hosts, out, script, code, record, *extra) -> tuple[list[int], str, str]:
    """Run a two-node job while the third host runs `code`; codes, logs, its last line."""
    a, b, third = hosts
    out.mkdir(parents=True)
    spy = third.popen(
        [sys.executable, "-c", code, a.address, str(MASTER_PORT), str(record), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    node = [[*node_args(a, rank, nproc=1, extra=FLAGS), TRAIN, *script] for rank in (0, 1)]
    launchers: list[Launcher] = []
    try:
        _await(Path(f"{record}.ready"), spy)  # torch imported
        launchers.append(Launcher(node[0], out / "node0.log", a))
        _await(Path(f"{record}.connected"), spy)  # at node 0's store: node 1 may start
        launchers.append(Launcher(node[1], out / "node1.log", b))
        codes = wait_all(launchers, 180)
    finally:
        for launcher in launchers:
            launcher.kill()
        try:
            said, errors = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            said, errors = spy.communicate()
    said = said.strip().splitlines()[-1] if said.strip() else f"nothing; stderr: {errors}"
    return codes, "\n".join(launcher.log() for launcher in launchers), said


def _await(path: Path, spy: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert spy.poll() is None and time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def earlier_job(hosts3m, tmp_path_factory) -> dict:
    """A job that ran ~25 s (heartbeats counted past 25) and ended with rank 1 SIGKILLed."""
    out = tmp_path_factory.mktemp("earlier")
    record = out / "record.json"
    script = ["--out", str(out / "run"), "--steps", "30", "--step-sleep", "1.0"]
    script += ["--kill-rank", "1", "--kill-step", "22"]
    codes, logs, said = _job(hosts3m, out / "run", script, RECORD, record)
    assert codes == [1, 1] and "killed by signal SIGKILL" in logs, logs
    values = json.loads(record.read_text())
    assert {"open", "node/0", "report/1", "alive/0", "alive/1"} <= set(values), said
    assert "SIGKILL" in values["report/1"], values["report/1"]
    return values


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", ["report", "heartbeats", "open"])
def test_a_value_replayed_from_an_earlier_job_is_ignored(
    what, hosts3m, earlier_job, tmp_path, lockstep_run_reference
):
    record = tmp_path / "record.json"
    record.write_text(json.dumps(earlier_job))
    out = tmp_path / "run"
    script = ["--out", str(out), "--steps", str(STEPS), "--step-sleep", "6.0"]  # 24 s > 10 s
    codes, logs, said = _job(hosts3m, out, script, REPLAY, record, what, str(out))
    assert said == json.dumps({"replayed": what}), said
    assert codes == [0, 0], logs
    assert "restart" not in logs.replace("restart 0 starts", "") and "lost node" not in logs
    assert "SIGKILL" not in logs, logs
    resumed = final_params(out)
    for name, value in lockstep_run_reference.items():
        assert torch.equal(resumed[name], value), name
    if what == "open":  # node 0 put its own back, and said why
        assert "values not sealed for this job keep appearing" in logs, logs
