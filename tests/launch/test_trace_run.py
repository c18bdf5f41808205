"""LOCKSTEP_TRACE on a plain DDP script, under `lockstep run` and torchrun, and `run --trace`.

The script (train_plain_ddp.py) has no Monitor and no trace code; each rank
appends the engine's own step figures to a file, the oracle every trace event
is compared with: per step the forward, backward and data slices, per bucket
the ready instant and the all-reduce slice (duration and position to the
microsecond). `lockstep run --trace` must also merge, draw the timeline and name
the rank made slow on purpose; a worker killed with SIGKILL must leave a
readable trace up to its last background write. Across two nodes (network
namespaces) each launcher reports its own ranks and `lockstep trace merge` joins them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launchkit import Launcher, node_args, wait_all

from lockstep.cli import main as cli_main
from lockstep.observe import load_events

# Each runs a real job under a launcher, then merges and draws its trace.
pytestmark = pytest.mark.slow
SCRIPT = str(Path(__file__).with_name("train_plain_ddp.py"))
PNG = b"\x89PNG\r\n\x1a\n"
FAST_FLUSH = {"LOCKSTEP_TRACE_FLUSH_S": "0.2"}


def _oracle(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"stats_rank{rank}.jsonl").read_text().splitlines()]


def _check_rank(trace_dir: Path, out: Path, rank: int, steps: list[int] | None = None) -> None:
    """Every step of the oracle (or `steps` of it) is in the trace, bucket by bucket."""
    document = json.loads((trace_dir / f"trace_rank{rank}.json").read_text())
    assert document["otherData"] == {"rank": rank, "world_size": 2}
    events = document["traceEvents"]
    oracle = [r for r in _oracle(out, rank) if steps is None or r["step"] in steps]
    traced = {e["args"]["step"] for e in events if "step" in e.get("args", {})}
    assert traced == {r["step"] for r in oracle}
    previous_end = None
    for record in oracle:
        mine = [e for e in events if e.get("args", {}).get("step") == record["step"]]
        by_cat = {e["cat"]: e for e in mine if e["cat"] not in ("ready", "allreduce")}
        assert {"step", "forward", "backward"} <= set(by_cat)
        forward = by_cat["forward"]
        assert forward["dur"] == pytest.approx(record["forward"] * 1e6, abs=0.01)
        if previous_end is not None:  # the gap since the last step: optimizer and data
            data = by_cat["data"]
            assert data["ts"] == pytest.approx(previous_end, abs=1.0)
            assert data["ts"] + data["dur"] == pytest.approx(forward["ts"], abs=1.0)
        previous_end = by_cat["step"]["ts"] + by_cat["step"]["dur"]
        _check_buckets(mine, forward["ts"], record["buckets"])


def _check_buckets(events: list[dict], start_us: float, buckets: list[list]) -> None:
    ready = {e["args"]["bucket"]: e for e in events if e["cat"] == "ready"}
    comm = {e["args"]["bucket"]: e for e in events if e["cat"] == "allreduce"}
    assert sorted(ready) == sorted(comm) == [b[0] for b in buckets]
    assert len(buckets) >= 3  # the script's small caps split the model
    for index, nbytes, t_ready, t_launched, t_done in buckets:
        assert ready[index]["ph"] == "i" and comm[index]["ph"] == "X"
        assert comm[index]["args"]["bytes"] == nbytes
        # ts are epoch microseconds (a double holds them to 0.25 us)
        assert ready[index]["ts"] - start_us == pytest.approx(t_ready * 1e6, abs=1.0)
        assert comm[index]["ts"] - start_us == pytest.approx(t_launched * 1e6, abs=1.0)
        assert comm[index]["dur"] == pytest.approx((t_done - t_launched) * 1e6, abs=0.01)


@pytest.mark.soak
def test_env_trace_of_a_plain_script_under_lockstep_run(tmp_path):
    trace, out = tmp_path / "trace", tmp_path / "out"
    argv = ["--nproc-per-node", "2", SCRIPT, "--out", str(out)]
    launcher = Launcher(argv, tmp_path / "run.log", env={"LOCKSTEP_TRACE": str(trace)})
    assert launcher.wait(timeout=180) == 0, launcher.log()
    for rank in (0, 1):
        _check_rank(trace, out, rank)
    assert "straggler" not in launcher.log()  # the report is --trace's, not the variable's


@pytest.mark.soak
def test_env_trace_of_a_plain_script_under_torchrun(tmp_path):
    trace, out = tmp_path / "trace", tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        SCRIPT,
        "--out",
        str(out),
    ]
    env = {**os.environ, "LOCKSTEP_TRACE": str(trace), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        _check_rank(trace, out, rank)


def test_run_trace_merges_draws_and_names_the_straggler(tmp_path):
    trace, out = tmp_path / "trace", tmp_path / "out"
    argv = [
        "--trace",
        str(trace),
        "--nproc-per-node",
        "2",
        SCRIPT,
        "--out",
        str(out),
        "--steps",
        "8",
        "--slow-rank",
        "1",
        "--slow-ms",
        "60",
    ]
    launcher = Launcher(argv, tmp_path / "run.log")
    assert launcher.wait(timeout=180) == 0, launcher.log()
    log = launcher.log()
    assert f"trace: {trace / 'trace.json'}" in log
    assert f"timeline: {trace / 'timeline.png'}" in log
    assert (trace / "timeline.png").read_bytes()[:8] == PNG
    assert {e["pid"] for e in load_events(trace / "trace.json")} == {0, 1}
    line = next(line for line in log.splitlines() if "straggler" in line)
    assert "rank 1 made the others wait" in line, log
    wait_ms = float(line.split("wait ")[1].split(" ms")[0])
    assert 40 <= wait_ms <= 200, line  # 60 ms of sleep, measured on a shared machine


@pytest.mark.soak
def test_killed_worker_leaves_a_readable_trace_and_the_report_still_comes(tmp_path):
    trace, out = tmp_path / "trace", tmp_path / "out"
    argv = [
        "--trace",
        str(trace),
        "--nproc-per-node",
        "2",
        SCRIPT,
        "--out",
        str(out),
        "--steps",
        "50",
        "--kill-rank",
        "1",
        "--kill-step",
        "4",
    ]
    launcher = Launcher(argv, tmp_path / "run.log", env=FAST_FLUSH)
    assert launcher.wait(timeout=180) == 1, launcher.log()
    log = launcher.log()
    # Rank 1 died by SIGKILL right after its file showed step 3: its steps 1-3 are there.
    _check_rank(trace, out, 1, steps=[1, 2, 3])
    assert f"trace: {trace / 'trace.json'}" in log, log
    assert {e["pid"] for e in load_events(trace / "trace.json")} == {0, 1}
    assert "timeline: " in log


@pytest.mark.soak
@pytest.mark.netns
def test_two_nodes_report_their_own_ranks_and_trace_merge_joins_them(hosts, tmp_path):
    """No shared trace directory: each node's launcher merges its rank; the CLI joins them."""
    launchers = []
    for node, host in enumerate(hosts):
        trace, out = tmp_path / f"node{node}" / "trace", tmp_path / f"node{node}" / "out"
        flags = ["--trace", str(trace)]
        argv = [*node_args(hosts[0], node, nproc=1, extra=flags), SCRIPT, "--out", str(out)]
        launchers.append(Launcher(argv, tmp_path / f"node{node}.log", host))
    codes = wait_all(launchers, 240)
    logs = [launcher.log() for launcher in launchers]
    assert codes == [0, 0], "\n".join(logs)
    for node, log in enumerate(logs):
        merged = tmp_path / f"node{node}" / "trace" / f"trace_node{node}.json"
        assert f"trace: {merged}" in log, log
        assert {e["pid"] for e in load_events(merged)} == {node}
        assert "lockstep trace merge" in log  # how to join the nodes
    joined = tmp_path / "all.json"
    dirs = [str(tmp_path / f"node{node}" / "trace") for node in (0, 1)]
    assert cli_main(["trace", "merge", *dirs, "-o", str(joined)]) == 0
    assert {e["pid"] for e in load_events(joined)} == {0, 1}
    _check_rank(tmp_path / "node1" / "trace", tmp_path / "node1" / "out", 1)
