"""A rank that leaves with `sys.exit(0)` mid-training is named as the first cause.

Its peers then fail in their next collective with "Connection closed by peer", the
echo; the rank that left succeeded as far as torch's agent knows (exit code 0), so
every node used to name the echo. The bootstrap notes a script that ended well; the
launcher that ends a round puts such workers in its report, after real errors and
before echoes. On two nodes with one worker each, the node of the rank that left
also keeps watching once its workers are done, until every node's are.
"""

from __future__ import annotations

import pytest
from launchkit import TRAIN, Launcher, node_args, wait_all

pytestmark = pytest.mark.slow  # whole launcher runs

LEFT = "exit code 0: its script ended"
SCRIPT = ["--steps", "30", "--step-sleep", "0.2", "--exit-rank", "1", "--exit-step", "2"]


@pytest.mark.timeout(120)
def test_a_rank_that_leaves_early_is_the_first_failure_on_one_node(tmp_path):
    argv = ["--nproc-per-node", "2", TRAIN, "--out", str(tmp_path / "out"), *SCRIPT]
    launcher = Launcher(argv, tmp_path / "launcher.log")
    assert launcher.wait(timeout=100) == 1, launcher.log()
    log = launcher.log()
    first = log.split("first failure: ", 1)[1].splitlines()[0]
    assert first.startswith("rank 1 (") and LEFT in first, log


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_rank_that_leaves_early_is_the_first_failure_on_two_nodes(hosts, tmp_path):
    a, b = hosts
    script = [TRAIN, "--out", str(tmp_path / "out"), *SCRIPT]
    launchers = [
        Launcher([*node_args(a, rank, nproc=1), *script], tmp_path / f"node{rank}.log", host)
        for rank, host in enumerate((a, b))
    ]
    codes = wait_all(launchers, 240)
    logs = [launcher.log() for launcher in launchers]
    assert codes == [1, 1], logs
    for log in logs:
        first = log.split("first failure: ", 1)[1].splitlines()[0]
        assert first.startswith("rank 1 (node 1,") and LEFT in first, log
