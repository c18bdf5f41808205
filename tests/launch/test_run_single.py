"""`lockstep run` on one node: bad input, a failing worker, and stopping the launcher.

Restarts (logged with their cause, counted in the script) are tested across two
nodes in test_multinode.py.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from launchkit import TRAIN, Launcher, live_workers, wait_for

from lockstep import cli
from lockstep.launch.cli.parser import run_config


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["missing_script.py"], "script 'missing_script.py' not found"),
        (["--nproc-per-node", "0", TRAIN], "--nproc-per-node must be a positive integer"),
        (["--nproc-per-node", "two", TRAIN], "found 'two'"),
        (["--nnodes", "2", TRAIN], "--master-port is required with --nnodes > 1"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "1", TRAIN], "[0, 2)"),
        (["--max-restarts", "-1", TRAIN], "--max-restarts must be at least 0"),
    ],
)
def test_bad_flags_get_one_line_and_exit_code_2(capsys, flags, expected):
    message = _error(capsys, ["run", *flags])
    assert expected in message
    assert message.startswith("lockstep run: error:")
    assert len(message.strip().splitlines()) == 1


def test_slurm_variables_fill_in_the_placement(monkeypatch):
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    for name, value in {**slurm, "SLURM_JOB_NODELIST": "gpu[07-08]"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    parser = cli.build_parser()
    cfg = run_config(parser.parse_args(["run", "--nproc-per-node", "2", TRAIN]))
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "gpu07", 24242)
    explicit = parser.parse_args(["run", "--nproc-per-node", "2", "--master-port", "1234", TRAIN])
    assert run_config(explicit).master_port == 1234  # a flag wins over Slurm


def test_more_than_one_launcher_per_node_under_srun_is_refused_with_the_fix(monkeypatch):
    """`srun -n 2 lockstep run` (variables as a real srun step sets them) is refused."""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}
    for name, value in {**slurm, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1"}.items():
        monkeypatch.setenv(name, value)
    parser = cli.build_parser()
    with pytest.raises(ValueError, match=r"srun started 2 tasks on 1 node\(s\)") as info:
        run_config(parser.parse_args(["run", "--nproc-per-node", "2", TRAIN]))
    assert "srun --ntasks-per-node=1 lockstep run" in str(info.value)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # one task per node is fine
    assert run_config(parser.parse_args(["run", "--nproc-per-node", "2", TRAIN])).nnodes == 1


@pytest.mark.slow  # a whole launcher run
def test_bad_rank_variables_are_named_by_the_worker():
    """A script started by hand with inconsistent variables fails on init() with their names."""
    code = (
        "import os, lockstep\n"
        "for env in ({'RANK': '5', 'WORLD_SIZE': '2'}, {'RANK': 'x', 'WORLD_SIZE': '2'}):\n"
        "    os.environ.update(env)\n"
        "    try:\n"
        "        lockstep.init()\n"
        "    except lockstep.LockstepError as error:\n"
        "        print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    lines = done.stdout.splitlines()
    assert "RANK=5 is inconsistent: expected in [0, 2)" in lines[0]
    assert "RANK='x' is not an integer" in lines[1]


@pytest.mark.slow  # a whole launcher run
def test_failing_worker_gives_exit_code_and_summary_naming_rank_and_exception(tmp_path):
    flags = ["--nproc-per-node", "2"]
    script = ["--out", str(tmp_path), "--raise-rank", "1"]
    launcher = Launcher([*flags, TRAIN, *script], tmp_path / "launcher.log")
    assert launcher.wait(timeout=150) == 1
    log = launcher.log()
    summary = log[log.index("lockstep run: training failed") :]
    assert "first failure: rank 1 (node 0" in summary
    assert "exit code 1" in summary
    assert "in main" in summary  # the worker's own frames, not the launcher's
    assert "RuntimeError: planned failure on rank 1 at step 0 (restart 0)" in summary
    assert "ChildFailedError" not in log
    assert live_workers(tmp_path) == []


@pytest.mark.slow  # a whole launcher run
@pytest.mark.parametrize(
    ("stop", "nproc"),
    [
        pytest.param(signal.SIGTERM, 2, id="SIGTERM"),
        pytest.param(signal.SIGINT, 1, id="SIGINT", marks=pytest.mark.soak),
    ],
)
def test_stopping_the_launcher_leaves_no_worker_behind(tmp_path, stop, nproc):
    launcher = Launcher(
        ["--nproc-per-node", str(nproc), TRAIN, "--out", str(tmp_path), "--steps", "100000"],
        tmp_path / "launcher.log",
    )
    for rank in range(nproc):
        wait_for(tmp_path / "pids" / f"{rank}.0", 120, [launcher])
    assert len(live_workers(tmp_path)) == nproc
    launcher.proc.send_signal(stop)
    assert launcher.wait(timeout=60) == 128 + stop
    assert f"stopped by {stop.name}" in launcher.log()
    deadline = time.monotonic() + 10  # init reaps orphans; allow it a moment
    while live_workers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_workers(tmp_path) == []


SHUTDOWN_PROBE = """\
import atexit, os, sys, torch, lockstep
import torch.distributed as dist


def report():
    tasks = "/proc/self/task"
    threads = sorted(open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks))
    os.write(1, f"rank {rank} threads after shutdown: {threads}\\n".encode())


if sys.argv[1] == "own_group":  # the script makes the group itself, after import lockstep
    dist.init_process_group("gloo")
else:
    lockstep.init()
rank = dist.get_rank()
torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)  # imports torch._dynamo
dist.all_reduce(torch.ones(3))
# Reported at exit, after the script: the bootstrap has ended the groups by then
# (lockstep.teardown holds each one until the script ends, destroyed or not).
atexit.register(report)
if sys.argv[1] != "forgotten":  # forgotten: no shutdown(), the bootstrap leaves the group
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "ending",
    ["shutdown", *(pytest.param(e, marks=pytest.mark.soak) for e in ("forgotten", "own_group"))],
)
def test_no_group_thread_outlives_the_script_even_after_an_optimizer_is_made(tmp_path, ending):
    """An optimizer made after init() must not keep the group (and its gloo threads) alive.

    The threads are listed once the script ended (an atexit handler, which runs after
    the bootstrap ended the groups), whether the script destroyed its group or not.

    Threads still running while the interpreter shuts down made a worker that had
    trained correctly die with SIGABRT, now and then.
    """
    script = tmp_path / "probe.py"
    script.write_text(SHUTDOWN_PROBE)
    launcher = Launcher(["--nproc-per-node", "2", str(script), ending], tmp_path / "launcher.log")
    assert launcher.wait(timeout=150) == 0, launcher.log()
    # Both ranks write to the same log: find each report wherever it landed.
    reports = dict(re.findall(r"rank (\d) threads after shutdown: (\[[^\]]*\])", launcher.log()))
    assert sorted(reports) == ["0", "1"], launcher.log()
    for rank, threads in reports.items():
        assert "gloo" not in threads, f"rank {rank}: {threads}"


ABORTING = """\
import os, lockstep


def crash_in_native_code():
    os.abort()  # what a C++ std::terminate does


ctx = lockstep.init()
if ctx.rank == 1:
    crash_in_native_code()
lockstep.shutdown()
"""


@pytest.mark.slow  # a whole launcher run
def test_a_native_crash_shows_the_python_stack_where_it_happened(tmp_path):
    script = tmp_path / "aborting.py"
    script.write_text(ABORTING)
    launcher = Launcher(["--nproc-per-node", "2", str(script)], tmp_path / "launcher.log")
    assert launcher.wait(timeout=150) == 1
    log = launcher.log()
    assert "Fatal Python error: Aborted" in log
    assert 'aborting.py", line 5 in crash_in_native_code' in log
    summary = log[log.index("lockstep run: training failed") :]
    assert "rank 1" in summary and "SIGABRT" in summary
    assert "Fatal Python error" in summary  # the summary says where to look
