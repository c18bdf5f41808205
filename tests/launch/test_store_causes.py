"""Trouble in the launchers' store named by its true cause, not as a network failure.

Two hosts (network namespaces) run a real two-node `lockstep run`: nodes given
different secrets must say so on both sides within seconds, where a value that
does not open used to look like a node that never wrote (and, after the join
timeout, like a failed network).
"""

from __future__ import annotations

import pytest
from launchkit import TRAIN, Launcher, first_line_to_text, node_args, wait_all

pytestmark = [pytest.mark.netns, pytest.mark.slow]
REPORT_S = 10.0


@pytest.mark.timeout(120)
def test_mismatched_secrets_are_named_on_both_nodes_within_10_s(hosts, tmp_path):
    a, b = hosts
    script = [TRAIN, "--out", str(tmp_path / "out"), "--steps", "4"]
    launchers = [
        Launcher(
            [*node_args(a, rank, nproc=1), *script],
            tmp_path / f"node{rank}.log",
            host,
            env={"LOCKSTEP_JOB_SECRET": f"this-is-node-{rank}s-own-secret"},
        )
        for rank, host in enumerate((a, b))
    ]
    said = [f"node {rank}: the job secret differs from node {1 - rank}'s" for rank in (0, 1)]
    took = first_line_to_text(launchers, said, 60)
    codes = wait_all(launchers, 30)
    logs = [launcher.log() for launcher in launchers]
    print(f"mismatched secrets named {took:.1f} s after the last launcher's first line")
    assert took < REPORT_S, f"{took:.1f} s\n" + "\n".join(logs)
    assert codes == [1, 1], logs
    assert not any("network" in log for log in logs), logs
