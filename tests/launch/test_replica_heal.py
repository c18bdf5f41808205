"""`lockstep run`: a replica that differs is named at the next step; healed live, or stopped.

Real launchers, real workers, a real fault: the script flips one bit of one weight on
rank 1 after its optimizer's step (`train_replicas.py --flip`). The oracle is the same
script without the flip.

- Three ranks under `--live-recovery`: the step after the flip names rank 1, rank 1
  leaves and is replaced live with a majority rank's state, the survivors redo the
  step's reduction from their own gradients and the replacement recomputes it: the
  run ends bitwise equal to the oracle, with no restart.
- Two ranks: no majority. Both stop naming both; the checkpoint taken after the flip
  is never committed, the last one every rank agreed on stays `latest`; with
  `--max-restarts 1` the run rolls back to it and ends bitwise equal to the oracle.

With the check off (LOCKSTEP_CHECK_REPLICAS=0) the runs go on with the flipped bit:
the assertions fail (the replicas end apart, `latest` names a later step).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from launchkit import Launcher

SCRIPT = str(Path(__file__).with_name("train_replicas.py"))
STEPS = 8
WAIT_S = 240
CHECK = {"LOCKSTEP_CHECK_REPLICAS": os.environ.get("LOCKSTEP_CHECK_REPLICAS", "1")}


def _run(out: Path, nproc: int, flags: list[str], script: list[str]) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--nproc-per-node", str(nproc), *flags, SCRIPT, "--out", str(out)]
    env = {**CHECK, "LOCKSTEP_STALL_WARN_S": "60"}
    launcher = Launcher([*argv, "--steps", str(STEPS), *script], out / "launcher.log", env=env)
    return launcher.wait(WAIT_S), launcher.log()


def _final(out: Path, rank: int) -> dict[str, torch.Tensor]:
    state = torch.load(out / f"final_rank{rank}.pt")
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    for index, entry in state["optimizer"]["state"].items():
        flat.update({f"adam/{index}/{k}": torch.as_tensor(v) for k, v in entry.items()})
    return flat


def _assert_bitwise(out: Path, oracle: Path, world_size: int) -> None:
    for rank in range(world_size):
        mine, expected = _final(out, rank), _final(oracle, rank)
        differ = [k for k in mine if not torch.equal(mine[k], expected[k])]
        assert not differ, f"rank {rank} differs from the run without the flip in {differ}"


def _latest(out: Path) -> str:
    return (out / "ckpt" / "latest").read_text().strip()


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_replicas_name_the_flipped_one_and_heal_it_live_bitwise(tmp_path):
    oracle = tmp_path / "clean"
    code, log = _run(oracle, 3, [], [])
    assert code == 0, log
    # rank 1 flipped, rank 0 the donor; then rank 0 flipped (the writer), rank 1 the donor
    for flipped, donor, majority in ((1, 0, [0, 2]), (0, 1, [1, 2])):
        out = tmp_path / f"flip_{flipped}"
        flip = ["--flip", f"{flipped}:4"]  # after step 4, which no save follows
        code, log = _run(out, 3, ["--live-recovery"], flip)
        assert code == 0, log
        named = (
            f"replica check: replicas differ at synchronised step 6: rank(s) [{flipped}] hold "
            f"other parameters or buffers than the majority, rank(s) {majority}; the first "
            "that differs is parameter '3.weight'"
        )
        assert f"[rank {flipped}]: {named}: this rank's replica differs" in log, log
        leave = f"rank(s) [{flipped}] leave and are replaced live with the state of rank {donor}"
        assert f"[rank {donor}]: {named}: {leave}" in log, log
        replaced = f"live recovery: generation 1, rank(s) [{flipped}] replaced inside step 6"
        assert replaced in log, log
        assert "restart 1" not in log and "not possible" not in log, log
        processes = sorted(p.name for p in (out / "pids").iterdir())
        assert processes == sorted(["0.0.0", "1.0.0", "2.0.0", f"{flipped}.1.0"]), log
        _assert_bitwise(out, oracle, 3)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_replicas_stop_naming_both_and_keep_the_last_agreed_checkpoint(tmp_path):
    oracle = tmp_path / "clean"
    code, log = _run(oracle, 2, [], [])
    assert code == 0, log
    # the flip after step 4: step 5's backward finds it (synchronised step 6); the last
    # save every rank agreed on is step 3's
    out = tmp_path / "flip_4"
    code, log = _run(out, 2, ["--max-restarts", "0"], ["--flip", "1:4"])
    assert code != 0, log
    for rank in (0, 1):
        line = (
            "ReplicaMismatchError: replicas differ at synchronised step 6 and no majority "
            "holds the same state: rank(s) [0, 1] differ from each other"
        )
        assert line in log and f"(raised on rank {rank})" in log, log
    assert _latest(out) == "step_00000003.pt", log
    # the flip after step 3, before its save: the save is refused on both ranks
    out = tmp_path / "flip_3"
    code, log = _run(out, 2, ["--max-restarts", "0"], ["--flip", "1:3"])
    assert code != 0, log
    assert "rank 0 refused to commit checkpoint step 3: the replicas differ" in log, log
    assert "rank(s) [0, 1] hold different states" in log, log
    assert _latest(out) == "step_00000001.pt", log
    # with a restart allowed, the run rolls back to the agreed checkpoint and ends bitwise
    out = tmp_path / "flip_4_restart"
    code, log = _run(out, 2, ["--max-restarts", "1"], ["--flip", "1:4"])
    assert code == 0, log
    assert "rank 0 generation 0 starts at step 4" in log, log
    _assert_bitwise(out, oracle, 2)
