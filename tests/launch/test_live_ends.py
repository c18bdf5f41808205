"""`lockstep run --live-recovery` at the edges of a loss: after the last step, two at once,
and the survivors' own exit.

Real launchers, real workers, real SIGKILLs (`train_live.py` kills itself, and a peer,
at a chosen point). A rank lost after its peers' scripts ended ends the job at once,
failed, naming the rank, and nothing is restarted; two ranks killed microseconds apart
are replaced together in one generation, live and bitwise equal to the uninterrupted
run; survivors of a live recovery exit as promptly as any worker (the exit watch ends
nobody).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from launchkit import Launcher
from test_live_recovery import _assert_bitwise, _processes

SCRIPT = str(Path(__file__).with_name("train_live.py"))
STEPS = 6
WAIT_S = 240  # the code before: the replacement waited 300 s for peers that had ended
EXIT_WATCH = "finished its script"  # the exit watch's line when it ends a late worker
FINISHED = "the job ends failed, with no whole-group restart"


def _start(
    out: Path, kill: str, nproc: int, flags: tuple[str, ...] = (), script: tuple[str, ...] = ()
) -> Launcher:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", str(nproc), *flags, SCRIPT, "--out", str(out), *script]
    env = {"LOCKSTEP_TEST_KILL": kill, "LOCKSTEP_STALL_WARN_S": "60"}
    return Launcher([*argv, "--steps", str(STEPS)], out / "launcher.log", env=env)


def _run_ok(out: Path, kill: str, nproc: int, flags: tuple[str, ...] = ()) -> str:
    launcher = _start(out, kill, nproc, flags)
    code = launcher.wait(WAIT_S)
    assert code == 0, launcher.log()
    return launcher.log()


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_lost_after_the_last_step_ends_the_job_at_once_and_is_not_restarted(tmp_path):
    """Rank 1 SIGKILLed after its last step. "stepped": after its last update; rank 0
    stays in its script until the launcher started a replacement (`--linger`), which the
    launcher stops once rank 0's script ended without joining its generation. "ended":
    once rank 0's script ended (its bootstrap's post), and no replacement starts. No
    generation can form with rank 0. Before: the replacement waited LOCKSTEP_TIMEOUT_S
    (300 s) for rank 0, then the whole group restarted the finished job. Now the job
    ends within seconds of rank 0's end, failed (rank 1's own end of script, its final
    save here, did not run), with one line naming rank 1, and no restart although one
    is allowed."""
    flags = ("--live-recovery", "--max-restarts", "1")
    for where, script in (("stepped", ("--linger",)), ("ended", ())):
        out = tmp_path / where
        launcher = _start(out, f"1:{STEPS - 1}:{where}", 2, flags, script)
        code = launcher.wait(WAIT_S)
        ended = time.time()
        log = launcher.log()
        assert code != 0, (where, log)
        line = re.search(r"live recovery not possible: rank 1 \(pid \d+\) killed by [^\n]*", log)
        assert line, (where, log)
        assert "after rank(s) [0] ended their script" in line.group(0), (where, log)
        assert "what rank(s) [1] do after their last collective" in line.group(0), (where, log)
        assert FINISHED in line.group(0), (where, log)
        started = re.findall(r"started pid (\d+) as rank 1, generation 1", log)
        stopped = re.findall(r"its replacement pid (\d+) for generation 1 stopped", log)
        assert len(started) == (where == "stepped") and stopped == started, (where, log)
        assert "restart 1 of 1" not in log and "falling back" not in log, (where, log)
        assert [p for p in _processes(out) if not p.endswith(".0")] == [], (where, log)
        assert (out / "final_rank0.pt").exists() and not (out / "final_rank1.pt").exists()
        late = ended - (out / "final_rank0.pt").stat().st_mtime
        assert late < 60, (where, late, log)  # the exit of a run on a loaded machine, not 300 s


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_killed_at_once_are_replaced_live_in_one_generation(tmp_path):
    """Three ranks; inside backward of step 4, rank 1 SIGKILLs rank 2 and then itself,
    microseconds apart; rank 1 holds 512 MB more, so its exit outlasts rank 2's by some
    0.3 s (as a bigger rank's would): the launcher's look finds rank 2 gone and rank 1
    still exiting. Before: the launcher claimed generation 1 for rank 2 alone, saw rank
    1's death one watch interval later and fell back ("rank(s) [1] failed during the
    live recovery of generation 1"); with two equal exits it did so whenever one
    outlasted the other past a look. Now a worker still dying is waited for and the
    deaths are claimed together: rank 0 hands the state to both replacements, bitwise."""
    oracle = tmp_path / "uninterrupted"
    _run_ok(oracle, "", 3)
    out = tmp_path / "killed"
    log = _run_ok(out, "1:3:backward+2", 3, ("--live-recovery",))
    for rank in (1, 2):
        started = rf"live recovery: rank {rank} \(pid \d+\) killed by SIGKILL; started pid \d+ as "
        assert re.search(started + rf"rank {rank}, generation 1\n", log), log
    line = "[rank 0]: live recovery: generation 1, rank(s) [1, 2] replaced inside step 4"
    assert line in log, log
    assert "not possible" not in log and "restart 1" not in log, log
    assert _processes(out) == ["0.0.0", "1.0.0", "1.1.0", "2.0.0", "2.1.0"], log
    _assert_bitwise(out, oracle, world_size=3)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_survivors_of_a_live_recovery_exit_promptly(tmp_path):
    """Three ranks. At step 4 every rank leaves a broadcast on the group that never
    completes (ranks 0 and 2 each wait for the other: `--strand`), then rank 1 dies
    inside backward. The survivors re-form the group and finish, but their old group
    still holds that work, and a gloo group's destructor waits for its work: at exit
    each survivor waited for the other until the exit watch ended both (`--exit-grace`
    60 here), and the run still exited 0. Now the group from before the recovery is let
    go on a thread of its own, a bounded wait: the exit watch ends nobody, the
    launcher exits within seconds of the scripts' end, bitwise."""
    oracle = tmp_path / "uninterrupted"
    _run_ok(oracle, "", 3)
    out = tmp_path / "killed"
    script = ("--strand", "3:0,2")
    launcher = _start(out, "1:3:backward", 3, ("--live-recovery", "--exit-grace", "60"), script)
    code = launcher.wait(WAIT_S)
    exited = time.time()
    log = launcher.log()
    assert code == 0, log
    line = "[rank 0]: live recovery: generation 1, rank(s) [1] replaced inside step 4"
    assert line in log and "not possible" not in log, log  # the precondition: live
    assert EXIT_WATCH not in log, log
    last_final = max((out / f"final_rank{rank}.pt").stat().st_mtime for rank in range(3))
    assert exited - last_final < 40, (exited - last_final, log)  # the watch: 60 s and more
    _assert_bitwise(out, oracle, world_size=3)
