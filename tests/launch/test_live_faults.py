"""Live recovery at the remaining fault points, each run against one uninterrupted run.

Real launchers, real kills (`train_live_faults.py`, `train_live_plain.py`). One run
goes through four generations: a kill in backward (the sampler's place goes over), the
writer killed between its temporary file and the rename, a rank stuck in forward
(`--replace-stuck`), a non-writer killed before the save's barrier. It ends bitwise
equal to the oracle: parameters and Adam state, the sample ids each rank consumed step
by step (none skipped, none twice), and every checkpoint file, generators included.
A replacement that dies before it joins falls back to the whole-group restart with its
one-line reason; a script without Checkpointer gets the weights and the step count.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from launchkit import Launcher
from test_live_recovery import _assert_bitwise, _assert_recovered_live, _processes
from train_live_faults import BATCH, SAMPLES

from lockstep.checkpoint.files import CheckpointFiles
from lockstep.launch.cli.parser import add_parser, run_config

HERE = Path(__file__).parent
FAULTS, PLAIN = str(HERE / "train_live_faults.py"), str(HERE / "train_live_plain.py")
WAIT_S = 150
STEPS_PER_EPOCH = SAMPLES // (2 * BATCH)  # at world size 2; the script runs 8 steps


def _run(
    out: Path,
    script: str,
    flags: list[str],
    env: dict[str, str] | None = None,
    *args: str,
    nproc: int = 2,
) -> str:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", str(nproc), *flags, script, "--out", str(out), *args]
    env = {"LOCKSTEP_TEST_KILL": "", "LOCKSTEP_STALL_WARN_S": "60", **(env or {})}
    launcher = Launcher(argv, out / "launcher.log", env=env)
    code = launcher.wait(WAIT_S)
    log = launcher.log()
    assert code == 0, log
    return log


def _ids(out: Path, rank: int) -> list[str]:
    """'step id id ...' lines of every process of `rank`, by step (a step run twice shows)."""
    lines = [
        line for path in (out / "ids").glob(f"{rank}.*") for line in path.read_text().splitlines()
    ]
    return sorted(lines, key=lambda line: int(line.split()[0]))


def _same(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _assert_same_checkpoints(out: Path, oracle: Path) -> None:
    """No temporary file left; the same committed steps; each file the oracle's, bit for bit."""
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert names == sorted(p.name for p in (oracle / "ckpt").iterdir()), names
    files, expected = CheckpointFiles(out / "ckpt", 2), CheckpointFiles(oracle / "ckpt", 2)
    for step in (3, 7):
        mine = files.load(files.path_for(step), "cpu")  # the CRC check of every record too
        assert _same(mine, expected.load(expected.path_for(step), "cpu")), (out, step)
    assert files.find_latest("cpu")[0] == files.path_for(7)


# One run, four generations, against the oracle: the sampler's place (rank 1 dies in
# backward at step 2), the writer dies mid-write at step 3 (the save runs again), rank 0
# hangs in forward at step 5 (--replace-stuck), a non-writer dies before the barrier of
# the save of step 7 (committed already).
KILLS = "1:2:backward,0:3:save,0:5:hang,1:7:save"
PROCESSES = ["0.0.0", "0.2.0", "0.3.0", "1.0.0", "1.1.0", "1.4.0"]
LINES = [
    "[rank 0]: live recovery: generation 1, rank(s) [1] replaced "
    "inside step 3; step 3 finished again",
    "[rank 1]: live recovery: generation 2, rank(s) [0] replaced inside the save of step 3; "
    "the save runs again",
    "Stuck: rank 0 (last after step 5",
    "replace-stuck: rank 0 (pid",
    "live recovery: rank 0 (pid",
    "as rank 0, generation 3",
    "[rank 1]: live recovery: generation 3, rank(s) [0] replaced "
    "inside step 6; step 6 finished again",
    "[rank 0]: live recovery: generation 4, rank(s) [1] replaced inside the save of step 7; "
    "the save was committed already",
]


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_faults_in_four_generations_against_one_oracle(tmp_path):
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [])
    out = tmp_path / "four_generations"
    flags = ["--live-recovery", "--replace-stuck", "--stall-timeout", "6"]
    log = _run(out, FAULTS, flags, {"LOCKSTEP_TEST_KILL": KILLS})
    for line in LINES:
        assert line in log, (line, log)
    assert "restart 1" not in log and "not possible" not in log, log
    assert _processes(out) == PROCESSES, log
    _assert_bitwise(out, oracle)
    for rank in (0, 1):
        assert _ids(out, rank) == _ids(oracle, rank), (rank, _ids(out, rank))
    _assert_same_checkpoints(out, oracle)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_seed_left_to_rank_0_goes_over_when_rank_0_is_lost_in_the_first_step(tmp_path):
    """`shard(seed=None)`: each rank draws a seed, and all take rank 0's at the first
    pass's agreement, inside step 0. Rank 0 dies in that step's backward; its
    replacement must read rank 0's order (the agreed seed, sent by the donor), not the
    donor's own draw. No oracle run shares a random seed, so the observation is the
    data: in each epoch the two ranks' ids together are every sample at most once, and
    the first (whole) epoch every sample exactly once (before the fix, with the donor's
    own draw, 8 of the 40 were read twice in that epoch)."""
    env = {"LOCKSTEP_TEST_KILL": "0:0:backward"}
    log = _run(tmp_path, FAULTS, ["--live-recovery"], env, "--random-seed")
    line = "[rank 1]: live recovery: generation 1, rank(s) [0] replaced inside step 1; step 1"
    assert line in log, log
    assert _processes(tmp_path) == ["0.0.0", "0.1.0", "1.0.0"], log
    _assert_each_sample_once(tmp_path)


def _assert_each_sample_once(out: Path) -> None:
    """The two ranks' ids of 8 steps: the first epoch whole, each sample once; then 3
    steps of the next, none twice."""
    epochs: dict[int, list[int]] = {}
    for rank in (0, 1):
        for line in _ids(out, rank):
            step, *ids = map(int, line.split())
            epochs.setdefault(step // STEPS_PER_EPOCH, []).extend(ids)
    assert sorted(epochs[0]) == list(range(SAMPLES)), sorted(epochs[0])
    assert len(set(epochs[1])) == len(epochs[1]) == 3 * 2 * BATCH, sorted(epochs[1])


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_loss_met_in_the_samplers_agreement_is_recovered_live(tmp_path):
    """Rank 1 dies before its first batch while rank 0 waits in the sampler's agreement
    (the ranks' statements about the data, gathered before the first batch). With
    BatchNorm: rank 0 takes its own posted statement, keeps its buffers (what the first
    forward's broadcast carries) and skips that broadcast, as the replacement does.
    Bitwise equal to the uninterrupted run, buffers and sample ids included. Then with
    `seed=None` rank 0 dies there, before it posted: nobody has its seed, and the
    survivor and the replacement both take the donor's (each sample once)."""
    script = ("--batchnorm",)
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [], None, *script)
    out = tmp_path / "killed"
    log = _run(out, FAULTS, ["--live-recovery"], {"LOCKSTEP_TEST_KILL": "1:0:agreement"}, *script)
    line = "[rank 0]: live recovery: generation 1, rank(s) [1] replaced during the data's "
    line += "agreement before the first batch, at the start of the step"
    _assert_recovered_live(out, log, [line], ["0.0.0", "1.0.0", "1.1.0"])
    _assert_bitwise(out, oracle)
    for rank in (0, 1):
        assert _ids(out, rank) == _ids(oracle, rank), (rank, _ids(out, rank))
    out = tmp_path / "random_seed"
    env = {"LOCKSTEP_TEST_KILL": "0:0:agreement"}
    log = _run(out, FAULTS, ["--live-recovery"], env, "--random-seed")
    took = (
        "[rank 1]: live recovery: generation 1, rank(s) [0] replaced during the data's "
        "agreement before the first batch, at the start of the step; took rank 1's statement"
    )
    assert took in log, log
    assert _processes(out) == ["0.0.0", "0.1.0", "1.0.0"], log
    _assert_each_sample_once(out)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_survivors_between_steps_catch_up_with_a_peer_past_the_next_forward(tmp_path):
    """Three ranks, BatchNorm. Rank 1 dies inside rank 0's word on the save of step 3
    (its length received, not its bytes): rank 2, which rank 0 reaches directly, has it,
    leaves the save and waits in the next forward's buffer broadcast, while rank 0 is
    still in the save. Rank 2 takes the broadcast's value from rank 0's post and skips
    it; rank 0, recovered between steps, learns that a peer is past that start and does
    the same, as does the replacement (before: rank 0 and the replacement broadcast,
    rank 2 waited in the step's first bucket, and the run stalled). Bitwise, buffers
    and sample ids included."""
    script = ("--batchnorm",)
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [], None, *script, nproc=3)
    out = tmp_path / "killed"
    env = {"LOCKSTEP_TEST_KILL": "1:3:save_message"}
    log = _run(out, FAULTS, ["--live-recovery"], env, *script, nproc=3)
    lines = [
        "[rank 2]: live recovery: generation 1, rank(s) [1] replaced during the buffer "
        "broadcast of step 5, at the start of the step",
        "[rank 0]: live recovery: generation 1, rank(s) [1] replaced inside the save of "
        "step 3; the save was committed already",
        "[rank 0]: live recovery: a peer is already past the start of the next step",
    ]
    _assert_recovered_live(out, log, lines, ["0.0.0", "1.0.0", "1.1.0", "2.0.0"])
    _assert_bitwise(out, oracle, world_size=3)
    for rank in (0, 1, 2):
        assert _ids(out, rank) == _ids(oracle, rank), (rank, _ids(out, rank))


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_script_without_checkpointer_and_a_second_kill(tmp_path):
    """DDP + SGD without momentum: weights and step count are its whole state; then a
    replacement that dies before it joins makes the whole group restart, never hang."""
    oracle = tmp_path / "uninterrupted"
    _run(oracle, PLAIN, [])
    out = tmp_path / "killed"
    log = _run(out, PLAIN, ["--live-recovery"], {"LOCKSTEP_TEST_KILL": "1:3:backward"})
    told = (
        "lockstep [rank 1]: live recovery: without Checkpointer.restore(): received the "
        "weights, buffers and step count (3 steps finished, `ddp.finished_steps`) from rank "
        "0; not restored: the optimizer's state, the random state, the data position"
    )
    assert told in log, log
    assert _processes(out) == ["0.0.0", "1.0.0", "1.1.0"], log
    _assert_bitwise(out, oracle)
    # the replacement dies before it joins: a clean whole-group restart, said in one line
    out = tmp_path / "second_kill"
    env = {"LOCKSTEP_TEST_KILL": "1:3:backward", "LOCKSTEP_TEST_KILL_REPLACEMENT": "1:1"}
    log = _run(out, PLAIN, ["--live-recovery", "--max-restarts", "1"], env)
    assert (
        "live recovery not possible: rank(s) [1] failed during the live recovery of "
        "generation 1; falling back to the whole-group restart" in log
    ), log
    assert _processes(out) == ["0.0.0", "0.0.1", "1.0.0", "1.0.1"], log
    _assert_bitwise(out, oracle)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_survivors_a_step_end_apart(tmp_path):
    """Three ranks; rank 1 dies after step 5's fingerprint (the step's last collective),
    rank 2 finishes step 5 and meets the loss in step 6's buckets, while rank 0's wait on
    step 5's fingerprint ends with the loss (`behind`). Before, rank 0 ran step 5 again
    and rank 2 step 6, and the group stalled: now rank 0 takes step 5's outcome from rank
    2, rank 2 hands the state over, and the run ends bitwise equal to the uninterrupted
    one, each sample read once. Had rank 0 still been in step 5's last bucket
    (`behind_bucket`), it would lack that step's averaged gradients, which rank 2 has
    applied: every survivor falls back at once with that reason."""
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [], nproc=3)
    out = tmp_path / "behind"
    env = {"LOCKSTEP_TEST_KILL": "1:4:end_step,0:4:behind"}
    log = _run(out, FAULTS, ["--live-recovery"], env, nproc=3)
    lines = [
        "[rank 0]: live recovery: generation 1, rank(s) [1] replaced inside step 5, in its "
        "fingerprint (its last collective), which rank(s) [2] had finished; step 5 ended "
        "with their outcome, nothing run again",
        "[rank 2]: live recovery: generation 1, rank(s) [1] replaced inside step 6; step 6 "
        "finished again",
    ]
    _assert_recovered_live(out, log, lines, ["0.0.0", "1.0.0", "1.1.0", "2.0.0"])
    _assert_bitwise(out, oracle, world_size=3)
    for rank in (0, 2):
        assert _ids(out, rank) == _ids(oracle, rank), (rank, _ids(out, rank))
    # rank 1 died after step 5's last collective, before it wrote down that step's ids
    expected = [line for line in _ids(oracle, 1) if not line.startswith("4 ")]
    assert _ids(out, 1) == expected, _ids(out, 1)
    out = tmp_path / "behind_bucket"
    env = {"LOCKSTEP_TEST_KILL": "1:4:end_step,0:4:behind_bucket"}
    log = _run(out, FAULTS, ["--live-recovery", "--max-restarts", "1"], env, nproc=3)
    assert (
        "live recovery not possible: rank 0: survivor rank 0 met the loss in a bucket of "
        "step 5 with 4 steps finished, while rank(s) [2] had finished 5: rank 0 lacks that "
        "step's averaged gradients, and the ranks that had them applied them already"
    ) in log, log
    _assert_bitwise(out, oracle, world_size=3)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_survivor_a_step_behind_skips_what_those_ahead_skipped(tmp_path):
    """As above, with BatchNorm and a Monitor: rank 2, past step 5, meets the loss in
    step 6's buffer broadcast (from rank 0, still in step 5's fingerprint), or, one step
    later, in the Monitor's loss average after step 6. Rank 0 then skips the same: it
    takes step 6's broadcast from its own post, or goes on without that average, as
    rank 2 did; both runs end bitwise equal to the uninterrupted one, buffers included."""
    script = ("--batchnorm", "--monitor")
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [], None, *script, nproc=3)
    met = {
        4: "during the buffer broadcast of step 6, at the start of the step",
        5: "during the Monitor's loss average of step 6, between steps",
    }
    for step, where in met.items():
        out = tmp_path / f"behind_{step}"
        env = {"LOCKSTEP_TEST_KILL": f"1:{step}:end_step,0:{step}:behind"}
        log = _run(out, FAULTS, ["--live-recovery"], env, *script, nproc=3)
        lines = [
            f"[rank 0]: live recovery: generation 1, rank(s) [1] replaced inside step "
            f"{step + 1}, in its fingerprint (its last collective), which rank(s) [2] had "
            "finished",
            f"[rank 2]: live recovery: generation 1, rank(s) [1] replaced {where}",
        ]
        _assert_recovered_live(out, log, lines, ["0.0.0", "1.0.0", "1.1.0", "2.0.0"])
        _assert_bitwise(out, oracle, world_size=3)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_torch_script_that_makes_its_own_group_is_recovered_live(tmp_path):
    """A torch script (`--torch`: torch's `init_process_group` and DDP class, lockstep's
    engine by `--engine lockstep`). Its replacement joined the job's first group, where
    nobody was, and waited in the hand-over's broadcast while rank 0 waited for it in
    the new group, until the collective timeout; now torch's call joins the new group,
    and the run ends bitwise equal to the uninterrupted one."""
    flags, script = ["--engine", "lockstep"], ("--torch",)
    oracle = tmp_path / "uninterrupted"
    _run(oracle, PLAIN, flags, None, *script)
    out = tmp_path / "killed"
    env = {"LOCKSTEP_TEST_KILL": "1:3:backward", "LOCKSTEP_TIMEOUT_S": "60"}
    log = _run(out, PLAIN, [*flags, "--live-recovery"], env, *script)
    line = "[rank 0]: live recovery: generation 1, rank(s) [1] replaced inside step 4"
    _assert_recovered_live(out, log, [line], ["0.0.0", "1.0.0", "1.1.0"])
    _assert_bitwise(out, oracle)


def test_replace_stuck_needs_live_recovery():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(ValueError, match="--replace-stuck replaces a stuck worker live: it"):
        run_config(parser.parse_args(["run", "--replace-stuck", FAULTS]))
    flags = ["run", "--live-recovery", "--replace-stuck", FAULTS]
    assert run_config(parser.parse_args(flags)).replace_stuck
