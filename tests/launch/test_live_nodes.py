"""`lockstep run --live-recovery` on two nodes (network namespaces), with real kills.

Node 0 runs in namespace a, node 1 in b, two workers each (`train_live.py`). The
oracle is one uninterrupted run of the same script, four workers on one node: final
parameters and Adam state of every rank must be bitwise equal. In one run (to keep
the suite short), a worker lost on either node (rank 3 on node 1, then rank 0 on
node 0) is replaced by its own node's launcher while every other process keeps
running, then a lost node (every process in its namespace SIGKILLed) started again
takes its place in the running job. A lost node that does not come back, and the
loss of node 0, end with the one-line reason.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from launchkit import Launcher, node_args, wait_all
from test_live_recovery import _assert_bitwise, _processes

from lockstep.launch.cli.parser import add_parser, run_config
from lockstep.launch.recovery import generations
from lockstep.launch.rendezvous.store import host
from lockstep.live import group as live_group
from lockstep.live import keys, sealed
from lockstep.testing.netns import Host, kill_inside

SCRIPT = str(Path(__file__).with_name("train_live.py"))
STEPS = 10
WAIT_S = 150
FLAGS = ["--live-recovery", "--rdzv-timeout", "20"]  # a node is lost after 10 s of silence
ENV = {"LOCKSTEP_STALL_WARN_S": "60"}


def _script(out: Path, sleep: float = 0.0) -> list[str]:
    steps = ["--steps", str(STEPS), "--save-every", "100", "--step-sleep", str(sleep)]
    return [SCRIPT, "--out", str(out), *steps]


def _node(host: Host, a: Host, rank: int, out: Path, flags: list[str], log: str, **kw) -> Launcher:
    script = _script(out, kw.get("sleep", 0.0))
    env = {**ENV, "LOCKSTEP_TEST_KILL": kw.get("kill", "")}
    argv = [*node_args(a, rank, nproc=kw.get("nproc", 2), extra=flags), *script]
    return Launcher(argv, out / log, host, env=env)


def _start(hosts: tuple[Host, Host], out: Path, flags: list[str], **kw) -> list[Launcher]:
    out.mkdir(parents=True, exist_ok=True)
    a, _ = hosts
    return [_node(h, a, r, out, flags, f"node{r}.log", **kw) for r, h in enumerate(hosts)]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """The uninterrupted run: four workers on one node (two nodes give the same bits)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    argv = ["--nproc-per-node", "4", *_script(out)]
    launcher = Launcher(argv, out / "launcher.log", env=ENV)
    assert launcher.wait(WAIT_S) == 0, launcher.log()
    return out


def _await_line(launcher: Launcher, line: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while line not in launcher.log():
        assert launcher.proc.poll() is None, launcher.log()
        assert time.monotonic() < deadline, launcher.log()
        time.sleep(0.05)


def two_nodes(test):
    """Namespaces (one at a time under xdist), seconds of processes, a bound on the whole."""
    return pytest.mark.netns(pytest.mark.slow(pytest.mark.timeout(400)(test)))


@pytest.mark.soak
@two_nodes
def test_workers_lost_on_either_node_then_a_lost_node_are_recovered_live(oracle, hosts, tmp_path):
    """One run, three generations, each claimed by a different launcher: rank 3 (node 1)
    dies in backward of step 1, rank 0 (node 0) in forward of step 3; after step 4 every
    process of node 1 is SIGKILLed and `lockstep run --node-rank 1` is started again.
    Rank 1 keeps one process throughout; the result is bitwise the uninterrupted one."""
    a, b = hosts
    node0, node1 = _start(hosts, tmp_path, FLAGS, kill="3:1:backward,0:3:forward", sleep=0.2)
    _await_line(node1, "rank 3 finished step 4")  # generation 2 formed: step 4 needed all
    kill_inside(b.namespace)
    again = _node(b, a, 1, tmp_path, FLAGS, "node1_again.log", sleep=0.2)
    codes = wait_all([node0, again], WAIT_S)
    log0, log1, log1b = node0.log(), node1.log(), again.log()
    assert codes == [0, 0], log0 + log1b
    assert "live recovery: rank 3 (pid" in log1 and "generation 1" in log1, log1
    assert "live recovery: rank 0 (pid" in log0 and "generation 2" in log0, log0
    for rank, log in ((0, log0), (1, log0), (2, log1)):
        assert f"[rank {rank}]: live recovery: generation 1, rank(s) [3] replaced" in log, log
    assert "node 1 was lost" in log0 and "node 1 rejoined" in log0, log0
    assert "rejoined the running job: ranks [2, 3] started in generation 3" in log1b, log1b
    assert "[rank 1]: live recovery: generation 3, rank(s) [2, 3] replaced" in log0, log0
    assert "restart 1" not in log0 + log1 + log1b
    # '<rank>.<generation>.<restart>': every process that ran the script
    expected = ["0.0.0", "0.2.0", "1.0.0", "2.0.0", "2.3.0", "3.0.0", "3.1.0", "3.3.0"]
    assert _processes(tmp_path) == expected, log0 + log1 + log1b
    _assert_bitwise(tmp_path, oracle, world_size=4)


@pytest.mark.soak
@two_nodes
def test_a_lost_node_not_back_in_time_ends_with_one_line(hosts, tmp_path):
    node0, _ = _start(hosts, tmp_path, [*FLAGS, "--rejoin-timeout", "2"], sleep=0.3, nproc=1)
    _await_line(node0, "rank 0 finished step 1")
    kill_inside(hosts[1].namespace)
    assert node0.wait(WAIT_S) == 1, node0.log()
    assert "node 1 was lost (no heartbeat for" in node0.log()
    line = "live recovery not possible: node 1 did not rejoin within 2 s (--rejoin-timeout)"
    assert line in node0.log(), node0.log()


@pytest.mark.soak
@two_nodes
def test_node_0_lost_falls_back_with_one_line(hosts, tmp_path):
    _, node1 = _start(hosts, tmp_path, FLAGS, sleep=0.3, nproc=1)
    _await_line(node1, "rank 1 finished step 1")
    kill_inside(hosts[0].namespace)
    assert node1.wait(WAIT_S) == 1, node1.log()
    assert "live recovery not possible: node 0 was lost" in node1.log(), node1.log()


def test_rejoin_timeout_is_validated():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    flags = ["run", "--nnodes", "2", "--master-port", "29500", "--live-recovery", SCRIPT]
    cfg = run_config(parser.parse_args(flags))
    assert cfg.live_recovery and cfg.rejoin_timeout_s == 120
    assert run_config(parser.parse_args([*flags[:-1], "--rejoin-timeout", "7", SCRIPT]))
    for bad in ("0", "-3"):
        ns = parser.parse_args([*flags[:-1], "--rejoin-timeout", bad, SCRIPT])
        with pytest.raises(ValueError, match="--rejoin-timeout must be a positive number"):
            run_config(ns)


class _Interleaved:
    """A worker-store client that lets another launcher claim just before its own swap."""

    def __init__(self, store, other) -> None:
        self.store, self.other = store, other

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.other()
        return self.store.compare_set(key, expected, desired)


def test_generations_are_claimed_once_for_the_whole_job(monkeypatch):
    """Two nodes that lose a worker at once: one claim wins, the other falls back; a claim
    while a generation forms is refused; once every rank joined, the next number follows."""
    monkeypatch.setenv(sealed.SECRET_VARIABLE, "a-secret-of-this-test-only")
    server, port = host("127.0.0.1", 0, 10)
    node0, node1 = (generations.client("127.0.0.1", port, 10) for _ in range(2))
    theirs: list[int | str] = []
    racing = _Interleaved(node0, lambda: theirs.append(generations.claim(node1, [3], 4)))
    mine = generations.claim(racing, [1], 4)
    assert theirs == [1]
    assert mine == "rank(s) [1] failed while another node announced generation 1 for rank(s) [3]"
    assert "generation 1 (rank(s) [3]) was still forming" in str(generations.claim(node0, [1], 4))
    for rank in range(4):
        sealed.put(node0, keys.JOINED.format(generation=1, rank=rank), 1)
    assert generations.claim(node0, [1], 4) == 2
    assert live_group.read_announcement(node1) == (2, [1])
    del server
