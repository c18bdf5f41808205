"""Failure reports, node-rank checks and route finding: the pure parts of the launcher."""

from __future__ import annotations

from dataclasses import asdict

from lockstep.launch.diagnostics.report import cause_line, summarize
from lockstep.launch.rendezvous.claims import NodeInfo, duplicate_message
from lockstep.launch.rendezvous.netif import route_to
from lockstep.launch.supervise.group import NodeReport, WorkerFailure, first_failure

RESET = "RuntimeError: Read error [10.0.0.2]:1234: Connection reset by peer."


def _failure(rank: int, node: int, how: str, message: str, detected: float) -> WorkerFailure:
    return WorkerFailure(
        rank, rank % 2, node, f"host{node}", 100 + rank, how, message, [], detected
    )


def _reports() -> dict[int, NodeReport]:
    echo = _failure(0, 0, "exit code 1", RESET, detected=1.0)  # seen first, but an echo
    cause = _failure(3, 1, "killed by signal SIGKILL", "", detected=2.0)
    return {
        0: NodeReport(0, "host0", "10.0.0.1", "workers failed", [echo]),
        1: NodeReport(1, "host1", "10.0.0.2", "workers failed", [cause]),
    }


def test_the_cause_beats_its_echo_even_when_seen_later():
    first = first_failure(_reports())
    assert (first.rank, first.how) == (3, "killed by signal SIGKILL")


def test_summary_is_the_same_on_every_node_but_the_header():
    texts = [summarize(_reports(), 2, node).splitlines() for node in (0, 1)]
    assert texts[0][1:] == texts[1][1:]
    text = "\n".join(texts[0])
    assert "first failure: rank 3 (node 1, host1, local rank 1, pid 103): killed by signal" in text
    assert "no Python traceback" in text
    assert "node 0 (host0, 10.0.0.1): workers failed (also failed: ranks 0)" in text


def test_a_silent_node_is_named_when_only_echoes_arrived():
    reports = {0: _reports()[0]}
    assert cause_line(reports, 2).startswith("node 1 sent no report")
    assert "node 1: sent no report" in summarize(reports, 2, 0)


def test_a_stopped_node_is_the_cause_when_no_worker_failed():
    reports = {
        0: NodeReport(0, "h0", "a0", "stopped its workers after a failure on another node"),
        1: NodeReport(1, "h1", "a1", "its launcher was stopped by SIGTERM", final=True),
    }
    assert cause_line(reports, 2) == "node 1 (h1): its launcher was stopped by SIGTERM"


def test_report_survives_the_store_round_trip():
    report = _reports()[1]
    assert NodeReport.from_dict(asdict(report)) == report


def test_two_nodes_with_one_node_rank_are_named():
    message = duplicate_message(NodeInfo(1, "h1", "a1"), NodeInfo(1, "h2", "a2"), 3)
    assert "two nodes were started with --node-rank 1: h1 (a1) and h2 (a2)" in message
    assert "0..2 exactly once" in message


def test_route_to_loopback_uses_lo():
    route = route_to("127.0.0.1")
    assert (route.local_addr, route.interface) == ("127.0.0.1", "lo")
    assert route_to("127.0.0.1", local_addr="127.0.0.2").local_addr == "127.0.0.2"


def test_a_rank_that_left_early_comes_after_real_errors_and_before_echoes():
    message = "its script ended (sys.exit(0), or a return) while other ranks were still running"
    left = _failure(1, 1, "exit code 0", message, detected=1.0)
    echo = _failure(0, 0, "exit code 1", RESET, detected=0.5)
    error = _failure(2, 0, "exit code 1", "ValueError: loss is nan", detected=2.0)
    reports = {
        0: NodeReport(0, "h0", "a0", "workers failed", [echo]),
        1: NodeReport(1, "h1", "a1", "x", [left]),
    }
    assert first_failure(reports) == left
    reports[0] = NodeReport(0, "h0", "a0", "workers failed", [echo, error])
    assert first_failure(reports) == error
    assert "rank 1 (node 1, host1, local rank 1, pid 101): exit code 0: its script" in summarize(
        {1: reports[1]}, 2, 0
    )
