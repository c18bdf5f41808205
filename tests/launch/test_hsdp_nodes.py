"""HSDP on two namespace nodes x 2 workers: only the shards' all-reduce crosses the link.

Node 0 runs in namespace a, node 1 in b (`lockstep run`, two workers each). Each
step the workers' veth counter of node 0 (bytes it sent to node 1) is read
between barriers. Theory (`plan/hybrid.py`): HSDP's all-gathers and its
reduce-scatter stay inside the node, and each worker all-reduces its shard's
share (P / 2) with its replica on the other node: 2(M-1)/M x P = P per node per
step; flat stage 3 rings every collective through the link: (N-1)/N (P + 2W) =
2.25 P. Measured over the veth includes Ethernet/IP/TCP headers, the acks of the
other direction and two barriers: within 10% above theory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launchkit import Launcher, node_args, wait_all

from lockstep.plan.hybrid import link_bytes
from lockstep.testing.netns import two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.soak]
SCRIPT = str(Path(__file__).parents[2] / "benchmarks" / "hsdp_link_worker.py")
OVERHEAD = 1.10


def _run(out: Path) -> dict:
    """One two-node job: flat stage 3, then HSDP (the worker's --both)."""
    out.mkdir(parents=True, exist_ok=True)
    script = [SCRIPT, "--out", str(out), "--both"]
    with two_hosts() as (a, b):
        launchers = [
            Launcher([*node_args(a, rank), *script], out / f"launch{rank}.log", host)
            for rank, host in enumerate((a, b))
        ]
        codes = wait_all(launchers, 150)
        assert codes == [0, 0], "\n".join(launcher.log() for launcher in launchers)
    return json.loads((out / "node0.json").read_text())


@pytest.fixture(scope="module")
def measured(netns_ready, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("hsdp_nodes"))


def test_each_node_sends_its_shards_share_not_the_whole_gradient(measured):
    grad = measured["hsdp"]["grad_bytes"]
    theory = {row.label: row.across_per_node for row in link_bytes(2, 2, grad, grad, grad)}
    for kind, label in (("hsdp", "HSDP-3"), ("flat", "ZeRO-3")):
        for sent in measured[kind]["sent"][1:]:  # step 0 also opens connections
            assert theory[label] <= sent <= OVERHEAD * theory[label], (kind, sent, theory[label])
    assert theory["HSDP-3"] == grad and theory["ZeRO-3"] == 2.25 * grad
    assert max(measured["hsdp"]["sent"][1:]) < 0.5 * min(measured["flat"]["sent"][1:])


def test_step_stats_of_both_levels(measured):
    shard_bytes = 4 * measured["hsdp"]["shard_numel"]
    levels = measured["hsdp"]["wire_levels"]
    assert levels == {"reduce_scatter": shard_bytes, "replica_all_reduce": shard_bytes}
    assert measured["flat"]["wire_levels"] == {
        "reduce_scatter": 3 * 4 * measured["flat"]["shard_numel"]
    }
