"""Network cuts between two nodes (namespaces): a healed cut restarts and ends bitwise, a lasting
one ends both nodes naming the link.

The cut is real and silent: each veth end gets a queue of length 0 (`netns.cut`), so
every packet either way is dropped, with no reset and no error, as when a switch
dies (this kernel has no netem). It lasts longer than the heartbeat bound and than
the launcher's old 40 s watchdog, so a node must rejoin rather than give up.
"""

from __future__ import annotations

import time

import pytest
import torch
from launchkit import final_params, two_nodes, wait_all, wait_for

from lockstep.testing.netns import cut, heal

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.soak]
STEPS = 4  # as the session's `lockstep_run_reference`
HEALED_CUT_S = 45.0


def _start(a, b, out, flags):
    script = ["--out", str(out), "--steps", str(STEPS), "--step-sleep", "1.0"]
    launchers = two_nodes(a, b, out, ["--nproc-per-node", "1", *flags], script)
    wait_for(out / "pids" / "1.0", 150, launchers)
    return launchers


def test_a_healed_cut_longer_than_the_heartbeat_restarts_and_ends_bitwise(
    hosts, tmp_path, lockstep_run_reference
):
    a, b = hosts
    launchers = _start(a, b, tmp_path, ["--max-restarts", "1", "--rdzv-timeout", "60"])
    cut(a), cut(b)
    time.sleep(HEALED_CUT_S)
    heal(a), heal(b)
    codes = wait_all(launchers, 150)
    logs = [launcher.log() for launcher in launchers]
    assert codes == [0, 0], "\n".join(logs)
    for log in logs:
        assert "restart 1 of 1" in log, log
    assert (tmp_path / "restarts.txt").read_text() == "1"
    resumed = final_params(tmp_path)
    for name, value in lockstep_run_reference.items():
        assert torch.equal(resumed[name], value), name


def test_a_cut_that_never_heals_ends_both_nodes_naming_the_link(hosts, tmp_path):
    a, b = hosts
    launchers = _start(a, b, tmp_path, ["--max-restarts", "1", "--rdzv-timeout", "20"])
    cut(a), cut(b)
    started = time.monotonic()
    codes = wait_all(launchers, 120)
    took = time.monotonic() - started
    node0, node1 = (launcher.log() for launcher in launchers)
    assert codes == [1, 1], node0 + node1
    assert f"did not join; the network between node 0 ({a.address}) and node 1" in node0, node0
    assert "could not reach the rendezvous store on node 0" in node1, node1
    assert f"the network between node 1 ({b.address}) and node 0 ({a.address}) failed" in node1
    assert "no progress for" not in node0 + node1  # ended by the rendezvous, not the watchdog
    assert took < 90, f"the nodes took {took:.0f} s to give up"
