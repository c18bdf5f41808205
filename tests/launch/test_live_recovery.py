"""`lockstep run --live-recovery`: a worker SIGKILLed mid-step is replaced, its peer keeps going.

Real launchers, real workers, real kills (the script kills itself at a chosen point,
`train_live.py`). The oracle is the same script run without a kill: final parameters
and Adam state of every rank must be bitwise equal. A survivor keeps its process
(one pid file per rank and process) and the launcher restarts nothing; a fault live
recovery does not cover (the sharded engine) falls back to the whole-group restart
with its one-line reason.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from launchkit import Launcher

SCRIPT = str(Path(__file__).with_name("train_live.py"))
STEPS = 6
WAIT_S = 150


def _run(
    out: Path, flags: list[str], kill: str = "", script: tuple[str, ...] = (), nproc: int = 2
) -> Launcher:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", str(nproc), *flags, SCRIPT, "--out", str(out)]
    argv += ["--steps", str(STEPS)]
    env = {"LOCKSTEP_TEST_KILL": kill, "LOCKSTEP_STALL_WARN_S": "60"}
    launcher = Launcher([*argv, *script], out / "launcher.log", env=env)
    code = launcher.wait(WAIT_S)
    assert code == 0, launcher.log()
    return launcher


def _final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    state = torch.load(out / f"final_rank{rank}.pt")
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    for index, entry in state["optimizer"]["state"].items():
        flat.update({f"adam/{index}/{k}": torch.as_tensor(v) for k, v in entry.items()})
    return flat


def _assert_bitwise(out: Path, oracle: Path, world_size: int = 2) -> None:
    for rank in range(world_size):
        mine, expected = _final(out, rank), _final(oracle, rank)
        assert mine.keys() == expected.keys()
        differ = [k for k in mine if not torch.equal(mine[k], expected[k])]
        assert not differ, f"rank {rank} differs from the uninterrupted run in {differ}"


def _assert_recovered_live(out: Path, log: str, lines: list[str], processes: list[str]) -> None:
    """The survivors' lines are in the log, nothing restarted, these processes ran."""
    for line in lines:
        assert line in log, (line, log)
    assert "restart 1" not in log and "not possible" not in log, log
    assert _processes(out) == processes, log


def _processes(out: Path) -> list[str]:
    """'<rank>.<generation>.<restart>' for every process that started the script."""
    return sorted(p.name for p in (out / "pids").iterdir())


SCENARIOS = {
    # (a kill inside backward, buckets in flight, opens test_live_faults.py's run)
    # rank 1 dies before its update of step 1: rank 0 meets the loss in the Monitor's loss
    # average (a collective between steps, `--monitor`); later rank 0 (the writer) dies
    # after launching its buckets, before the step's last collective (the fingerprint,
    # which carries the non-finite verdict), where rank 1 waits, and the state comes
    # from rank 1's replacement
    # (the kill in forward is test_live_spares.py's and test_live_nodes.py's)
    "1:1:optimizer,0:3:fingerprint": (
        ["0.0.0", "0.2.0", "1.0.0", "1.1.0"],
        [
            "[rank 0]: live recovery: generation 1, rank(s) [1] replaced during the "
            "Monitor's loss average of step",
            "[rank 1]: live recovery: generation 2, rank(s) [0] replaced "
            "inside step 4; step 4 finished again",
        ],
    ),
    # rank 0 dies before its update of step 1: rank 1 meets the loss in the bucket
    # rebuild's broadcast before step 2, before rank 0 posted its order: rank 1, the
    # donor, posts its own, and the replacement adopts the layout rebuilt in that order
    "0:0:optimizer": (
        ["0.0.0", "0.1.0", "1.0.0"],
        [
            "[rank 1]: live recovery: generation 1, rank(s) [0] replaced during the bucket "
            "rebuild's broadcast of step 2, at the start of the step",
        ],
    ),
}


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_workers_are_replaced_and_the_run_ends_bitwise_equal(tmp_path):
    """Each scenario against one uninterrupted run (the oracle, computed once here)."""
    oracle = tmp_path / "uninterrupted"
    _run(oracle, [])
    for kill, (processes, lines) in SCENARIOS.items():
        out = tmp_path / kill.replace(":", "_").replace(",", "+")
        log = _run(out, ["--live-recovery"], kill=kill, script=("--monitor",)).log()
        for victim in [item.split(":")[0] for item in kill.split(",")]:
            assert f"live recovery: rank {victim} (pid" in log, (kill, log)
        for line in lines:
            assert line in log, (kill, line, log)
        assert re.search(r"step +6 +loss", log), log  # the Monitor's last interval, logged
        assert "restart 1" not in log, (kill, log)
        # survivors ran in one process; each replacement is its generation's, restart 0
        assert _processes(out) == processes, (kill, log)
        _assert_bitwise(out, oracle)
    # a loss met in a collective of the script's own: the fallback names it, and the
    # whole-group restart ends the run bitwise equal all the same
    out = tmp_path / "own_collective"
    flags = ["--live-recovery", "--max-restarts", "1"]
    log = _run(out, flags, kill="1:2:optimizer", script=("--own-collective",)).log()
    assert re.search(
        r"live recovery not possible: (rank\(s\) \[0\] failed during the live recovery of "
        r"generation 1: )?rank 0 failed in a collective of the script's own \(torch\.distributed"
        r"\.all_reduce, called at train_live\.py:\d+ \(run\)\), which live recovery does not "
        r"run again(, after rank\(s\) \[1\] were lost)?; falling back",
        log,
    ), log
    _assert_bitwise(out, oracle)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_buffers_broadcast_at_every_forward_are_recovered_live(tmp_path):
    """BatchNorm's running statistics, broadcast from rank 0 at each forward (torch's
    default). Rank 0 dies before its update of step 2: rank 1 meets the loss in the next
    forward's broadcast, and both it and rank 0's replacement take what the broadcast
    carries from rank 0's post (its buffers after its last forward, which no survivor
    holds); nobody broadcasts again. Then rank 1 dies inside backward of
    the last step: its replacement starts from the buffers broadcast at that step's start
    (not its donor's, which its forward moved) and does not broadcast (its peer is past
    it). Buffers included, bitwise."""
    script = ("--batchnorm",)
    oracle = tmp_path / "uninterrupted"
    _run(oracle, [], script=script)
    out = tmp_path / "killed"
    log = _run(out, ["--live-recovery"], kill="0:1:optimizer,1:5:backward", script=script).log()
    lines = [
        "[rank 1]: live recovery: generation 1, rank(s) [0] replaced during the buffer "
        "broadcast of step 3, at the start of the step",
        "[rank 0]: live recovery: generation 2, rank(s) [1] replaced "
        "inside step 6; step 6 finished again",
    ]
    _assert_recovered_live(out, log, lines, ["0.0.0", "0.1.0", "1.0.0", "1.2.0"])
    assert "model/4.running_mean" in _final(out, 0)
    _assert_bitwise(out, oracle)
    # the same in the last step: rank 1's own buffers end the run unchanged by a later
    # broadcast, so the value it took from the post shows in its final state
    out = tmp_path / "last_step"
    log = _run(out, ["--live-recovery"], kill="0:4:optimizer", script=script).log()
    line = "[rank 1]: live recovery: generation 1, rank(s) [0] replaced during the buffer "
    assert line + "broadcast of step 6, at the start of the step" in log, log
    _assert_bitwise(out, oracle)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_loss_some_survivors_met_past_the_rebuilds_broadcast_is_recovered_live(tmp_path):
    """Three ranks, BatchNorm; rank 1 dies as its second forward starts, before the bucket
    rebuild's broadcast of rank 0's ready order. gloo's broadcast delivers to rank 2
    directly: rank 2 has the order and waits in the same forward's buffer broadcast,
    while rank 0 still waits on its send to rank 1. Rank 0 takes the order from its own
    post and the buffers from its buffer post, nobody broadcasts either again, and the
    replacement adopts the rebuilt layout and those buffers (run again, the rebuild's
    broadcast met rank 2's next collective: gloo aborted on the size mismatch; without
    the buffers' part, rank 0 found none to hand over and the group restarted)."""
    script = ("--batchnorm",)
    oracle = tmp_path / "uninterrupted"
    _run(oracle, [], script=script, nproc=3)
    out = tmp_path / "killed"
    log = _run(out, ["--live-recovery"], kill="1:1:wrapper", script=script, nproc=3).log()
    lines = [
        "[rank 0]: live recovery: generation 1, rank(s) [1] replaced during the bucket "
        "rebuild's broadcast of step 2, at the start of the step",
        "[rank 2]: live recovery: generation 1, rank(s) [1] replaced during the buffer "
        "broadcast of step 2, at the start of the step",
    ]
    _assert_recovered_live(out, log, lines, ["0.0.0", "1.0.0", "1.1.0", "2.0.0"])
    _assert_bitwise(out, oracle, world_size=3)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_lost_after_its_steps_last_collective_hands_over_that_steps_random_state(
    tmp_path,
):
    """Rank 1 dies after step 3's last collective (the fingerprint), in the engine's
    end-of-step actions: rank 0 finishes step 3 and meets the loss in step 4. The
    replacement must take rank 1's dropout stream as after step 3. It was posted at
    the step's end, after that collective, so rank 1 never posted it and the donor sent
    step 2's: the run ended "recovered live" with every parameter different from the
    uninterrupted run. The post now goes out before the step's last collective."""
    oracle = tmp_path / "uninterrupted"
    _run(oracle, [])
    out = tmp_path / "killed"
    log = _run(out, ["--live-recovery"], kill="1:2:end_step").log()
    line = "[rank 0]: live recovery: generation 1, rank(s) [1] replaced inside step 4"
    _assert_recovered_live(out, log, [line], ["0.0.0", "1.0.0", "1.1.0"])
    _assert_bitwise(out, oracle)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_loss_in_the_monitors_closing_barrier_is_recovered_live(tmp_path):
    """Rank 1 dies after its last step, before its Monitor's `close()`; rank 0 is in the
    barrier that waits for every rank's trace file. Its replacement receives the state
    as after the last step, runs no step, closes its Monitor; rank 0's barrier runs
    again with it, and rank 0 merges the trace. The replacement's final state is the
    survivor's (DDP's replicas end equal), bitwise."""
    script = ("--monitor", "--trace")
    log = _run(tmp_path, ["--live-recovery"], kill="1:5:close", script=script).log()
    line = "[rank 0]: live recovery: generation 1, rank(s) [1] replaced during the Monitor's"
    assert line + " closing barrier of step" in log, log
    assert "restart 1" not in log, log
    assert _processes(tmp_path) == ["0.0.0", "1.0.0", "1.1.0"], log
    merged = json.loads((tmp_path / "trace" / "trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"] if "pid" in e} == {0, 1}
    replacement, survivor = _final(tmp_path, 1), _final(tmp_path, 0)
    assert replacement.keys() == survivor.keys()
    assert [k for k in survivor if not torch.equal(replacement[k], survivor[k])] == []


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddps_join_falls_back_inside_and_is_recovered_live_after(tmp_path):
    """Uneven inputs: the first 3 steps in DDP's Join, rank 1 running 2 (it shadows rank
    0's third). Rank 0 lost in that third step: the joined rank's shadows are not
    recovery points, every rank declared so from the context's making, and one line
    names it (the restart itself is the whole-group restart's, tested with the other
    fallbacks; here none is allowed). Rank 1 lost at step 5, after the context:
    recovered live; its replacement takes the Join's configuration, which torch keeps
    after the context (every forward still notifies it), and skips the notices of the
    step it resumes in (before: its notice met a survivor's gradient bucket and gloo
    aborted on the size mismatch). It ends bitwise equal to the uninterrupted run."""
    script = ("--uneven",)
    out = tmp_path / "inside"  # no restart allowed: the fallback's line is what is tested
    argv = ["--nproc-per-node", "2", "--live-recovery", SCRIPT, "--out", str(out), *script]
    env = {"LOCKSTEP_TEST_KILL": "0:2:backward", "LOCKSTEP_STALL_WARN_S": "60"}
    out.mkdir()
    launcher = Launcher(argv, out / "launcher.log", env=env)
    assert launcher.wait(WAIT_S) != 0, launcher.log()
    line = "live recovery not possible: rank 0: live recovery does not cover a loss inside DDP's"
    assert line + " Join (uneven inputs" in launcher.log(), launcher.log()
    oracle = tmp_path / "uninterrupted"
    _run(oracle, [], script=script)
    out = tmp_path / "after"
    log = _run(out, ["--live-recovery"], kill="1:4:backward", script=script).log()
    line = (
        "[rank 0]: live recovery: generation 1, rank(s) [1] replaced "
        "inside step 5; step 5 finished again"
    )
    _assert_recovered_live(out, log, [line], ["0.0.0", "1.0.0", "1.1.0"])
    _assert_bitwise(out, oracle)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sharded_engine_falls_back_to_the_whole_group_restart(tmp_path):
    """No survivor holds a lost rank's shards: one line says so, and the group restarts."""
    flags = ["--live-recovery", "--max-restarts", "1"]
    launcher = _run(tmp_path, flags, kill="1:4:forward", script=("--engine", "sharded"))
    log = launcher.log()
    assert "live recovery not possible: rank 0: lockstep.ShardedDataParallel keeps" in log, log
    assert "falling back to the whole-group restart" in log, log
    assert _processes(tmp_path) == ["0.0.0", "0.0.1", "1.0.0", "1.0.1"], log
