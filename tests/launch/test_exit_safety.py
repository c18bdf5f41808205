"""Workers leave once their script ended: no deadlock at exit, no abort, and a bound.

`exit_deadlock.py` makes torch's C++ Reducer free a gloo group while the group's
thread retires a work that needs the GIL: without `lockstep.teardown` it hangs every
time. `train_torch_ddp_exit.py` is the DDP tutorial's shape (torch's class, lockstep's or
lockstep.FSDP, in main()'s locals), run once per launcher and engine under `lockstep
run` and under torchrun with lockstep imported. Without `lockstep.teardown` about one
run in twenty of that shape hangs at exit, so only repeated runs can show it: `make
soak` runs each 10 times (50 runs: without teardown one hangs with a chance of 92%;
the test skips below 2 runs):

    LOCKSTEP_EXIT_RUNS=10 python -m pytest -q tests/launch/test_exit_safety.py -k repeat

`train_exit_blocks.py` blocks after its script ended: the launcher's exit watch names
the worker with its stack, ends it, and the exit code is the script's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole launcher runs, several seconds each

HERE = Path(__file__).parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RUN = [sys.executable, "-m", "lockstep.cli", "run", "--nproc-per-node", "2"]
RUNS = int(os.environ.get("LOCKSTEP_EXIT_RUNS", "0"))  # the repeated runs: `make soak`
SHAPES = [
    ("lockstep-run", "torch"),
    ("lockstep-run", "lockstep"),
    ("torchrun", "torch"),
    ("torchrun", "lockstep"),
    ("torchrun", "sharded"),
]
ONE_SHAPE_IN_TEST = [  # make test runs one of them; make soak the others (time)
    shape if shape == ("torchrun", "lockstep") else pytest.param(*shape, marks=pytest.mark.soak)
    for shape in SHAPES
]
HANG_S = 90


def launch(cmd: list[str], timeout: float = HANG_S) -> tuple[int | None, str, float]:
    """Exit code (None: still running after `timeout`, then killed), output, seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - start
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return None, out, time.monotonic() - start


def launcher(kind: str, script: str, *args: str) -> list[str]:
    if kind == "lockstep-run":
        return [*RUN, str(HERE / script), *args]
    return [TORCHRUN, "--nproc-per-node", "2", str(HERE / script), *args, "--lockstep"]


@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.parametrize("kind", [pytest.param("lockstep-run", marks=pytest.mark.soak), "torchrun"])
def test_a_group_freed_by_torchs_reducer_mid_collective_does_not_hang(kind):
    code, out, _ = launch(launcher(kind, "exit_deadlock.py"))
    assert code is not None, f"the workers did not exit within {HANG_S} s:\n{out[-3000:]}"
    assert code == 0 and out.count(": freed") == 2, out[-3000:]
    assert "terminate called" not in out, out[-3000:]


def _exits_cleanly(kind: str, engine: str, out_dir: Path) -> str | None:
    """None when one run ended with code 0, both ranks done, no abort; else what happened."""
    out_dir.mkdir()
    cmd = launcher(kind, "train_torch_ddp_exit.py", "--out", str(out_dir), "--engine", engine)
    code, out, _ = launch(cmd)
    done = sorted(p.name for p in out_dir.glob("done_*"))
    if code != 0 or "terminate called" in out or done != ["done_0", "done_1"]:
        return f"{'hung' if code is None else f'exit code {code}'}, {done}\n{out[-2000:]}"
    return None


@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.parametrize(("kind", "engine"), ONE_SHAPE_IN_TEST)
def test_the_tutorials_shape_runs_to_a_clean_exit(kind, engine, tmp_path):
    bad = _exits_cleanly(kind, engine, tmp_path / "run")
    assert bad is None, bad


@pytest.mark.soak
@pytest.mark.skipif(RUNS < 2, reason="repeated runs are make soak's (LOCKSTEP_EXIT_RUNS=10)")
@pytest.mark.timeout(max(RUNS, 1) * (HANG_S + 30) + 60)
@pytest.mark.parametrize(("kind", "engine"), SHAPES)
def test_repeat_runs_exit_without_hang_or_abort(kind, engine, tmp_path):
    bad = [
        f"run {run}: {what}"
        for run in range(RUNS)
        if (what := _exits_cleanly(kind, engine, tmp_path / str(run))) is not None
    ]
    assert not bad, f"{len(bad)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(bad)


@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.soak
@pytest.mark.parametrize("block", ["thread", "atexit"])
def test_a_worker_that_does_not_exit_after_its_script_is_named_and_ended(block):
    cmd = [*RUN, "--exit-grace", "2", str(HERE / "train_exit_blocks.py"), "--block", block]
    code, out, seconds = launch(cmd)
    assert code == 0, f"exit code {code} after {seconds:.0f} s:\n{out[-3000:]}"
    # The watch names a late rank with its stack; a peer still inside its grace when the
    # first is ended is stopped by torch's agent instead (a race): both end as successes.
    assert "finished its script" in out, out[-3000:]
    assert "block_forever" in out, out[-3000:]  # the stack shows where it blocks
    assert "rank(s) 0, 1 ended after their script succeeded" in out, out[-3000:]


@pytest.mark.soak
@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.parametrize("live", [False, True], ids=["restart", "live-recovery"])
def test_a_peer_stopped_inside_its_grace_after_its_script_succeeded_counts_as_success(live):
    """The watch ends rank 0; torch's agent then stops rank 1, whose script ended too.

    Under --live-recovery the worker the watch ended is no loss: nothing is replaced
    (a replacement would run the finished script again)."""
    script = str(HERE / "train_exit_blocks.py")
    flags = ["--live-recovery"] if live else []
    cmd = [*RUN, *flags, "--exit-grace", "2", script, "--block", "thread", "--late-rank", "1"]
    code, out, seconds = launch(cmd)
    assert code == 0, f"exit code {code} after {seconds:.0f} s:\n{out[-3000:]}"
    assert "rank 0 (local rank 0" in out and "finished its script" in out, out[-3000:]
    assert "ended after their script succeeded" in out, out[-3000:]
    assert "live recovery" not in out, out[-3000:]


@pytest.mark.soak
@pytest.mark.timeout(HANG_S + 60)
def test_a_failed_script_still_fails_when_its_peer_blocks_at_exit():
    script = str(HERE / "train_exit_blocks.py")
    cmd = [*RUN, "--exit-grace", "2", script, "--block", "thread", "--fail-rank", "1"]
    code, out, _ = launch(cmd)
    assert code == 1, f"exit code {code}:\n{out[-3000:]}"
    assert "failed on purpose" in out, out[-3000:]
