"""`--replace-stuck` with a frozen worker (SIGSTOP): named, replaced live, bitwise equal.

Real launcher, real SIGSTOP: the script stops itself at a chosen point
(`train_live_faults.py`), every thread of it (state T in /proc/<pid>/stat). Rank 1 of
three stops while it waits on a gradient bucket, and its peers then wait for it in the
same all-reduce: every worker noted a wait, and the watch once said the stuck rank was
on another node, blamed rank 0 and restarted the group. Rank 0 stops inside
`Checkpointer.save`, while rank 1 waits at the save's barrier: a save's waits note no
wait, and the watch once never fired. Both end with the frozen rank named and replaced
live, bitwise equal to the uninterrupted run (checkpoint files and sample ids too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_live_faults import FAULTS, _assert_same_checkpoints, _ids, _run
from test_live_recovery import _assert_bitwise, _assert_recovered_live

STALL_S = 6
FLAGS = ["--live-recovery", "--replace-stuck", "--stall-timeout", str(STALL_S)]
PROMPT_S = STALL_S + 10  # the watch looks about once a second; the machine may be busy


def _assert_named_promptly(log: str, named: str) -> None:
    """The watch's line names the frozen rank (and no other node), soon after the stop."""
    assert named in log, (named, log)
    assert "on another node" not in log, log
    quiet = re.search(r"stalled: no progress for (\d+) s\. Stuck: ", log)
    assert quiet is not None and int(quiet.group(1)) <= PROMPT_S, log


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_rank_frozen_in_a_bucket_all_reduce_is_replaced_live(tmp_path: Path) -> None:
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [], None, nproc=3)
    out = tmp_path / "frozen"
    log = _run(out, FAULTS, FLAGS, {"LOCKSTEP_TEST_KILL": "1:5:stop_wait"}, nproc=3)
    _assert_named_promptly(log, "Stuck: rank 1 (frozen, last waiting on gradient bucket")
    assert "replace-stuck: rank 1 (pid" in log, log
    lines = [
        f"[rank {rank}]: live recovery: generation 1, rank(s) [1] replaced inside step 6; "
        "step 6 finished again"
        for rank in (0, 2)
    ]
    _assert_recovered_live(out, log, lines, ["0.0.0", "1.0.0", "1.1.0", "2.0.0"])
    _assert_bitwise(out, oracle, world_size=3)
    for rank in (0, 1, 2):
        assert _ids(out, rank) == _ids(oracle, rank), (rank, _ids(out, rank))


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_rank_frozen_inside_a_checkpoint_save_is_replaced_live(tmp_path: Path) -> None:
    oracle = tmp_path / "uninterrupted"
    _run(oracle, FAULTS, [])
    out = tmp_path / "frozen"
    log = _run(out, FAULTS, FLAGS, {"LOCKSTEP_TEST_KILL": "0:3:stop_save"})
    _assert_named_promptly(log, "Stuck: rank 0 (frozen, last inside Checkpointer.save(step=3))")
    assert "replace-stuck: rank 0 (pid" in log, log
    line = (
        "[rank 1]: live recovery: generation 1, rank(s) [0] replaced inside the save of step 3; "
        "the save runs again"
    )
    _assert_recovered_live(out, log, [line], ["0.0.0", "0.1.0", "1.0.0"])
    _assert_bitwise(out, oracle)
    for rank in (0, 1):
        assert _ids(out, rank) == _ids(oracle, rank), (rank, _ids(out, rank))
    _assert_same_checkpoints(out, oracle)
