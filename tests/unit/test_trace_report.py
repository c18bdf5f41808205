"""The end-of-run report from trace files alone: straggler, per-node merge, joining nodes.

Traces are written by `TraceRecorder` from made-up engine stamps in which one
rank is ready late by a known amount; the report read back from the files must
agree with `straggler.analyze` run on the same stamps (the oracle), and name
the same rank and bucket.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.cli import main as cli_main
from lockstep.env import read_trace_flush_s
from lockstep.errors import EnvironmentConfigError
from lockstep.observe import load_events
from lockstep.observe.report import report_trace, trace_stragglers
from lockstep.observe.straggler import analyze
from lockstep.observe.trace import TraceRecorder, join_traces
from lockstep.runtime.step_stats import BucketRecord, StepStats

PNG = b"\x89PNG\r\n\x1a\n"
LATE_S = 0.030  # rank `slow` has bucket 1 ready this much later than the others


def _stats(step: int, start: float, late: float) -> StepStats:
    """Every rank's last all-reduce ends when the slow rank's bucket 1 is in (same wall time)."""
    buckets = (
        BucketRecord(0, 4096, 2, 0.010, 0.010, 0.050),
        BucketRecord(1, 1024, 2, 0.020 + late, 0.020 + late, 0.052 + LATE_S),
    )
    return StepStats(step, 3, 0.005, 0.020 + late, 5120, 6826, 0.07, 0.03, buckets, start)


def _write(directory, ranks, slow, steps=6):
    """Traces of `ranks`; returns the oracle tensors (ready, end) over all steps."""
    ready, end = [], []
    for rank in ranks:
        recorder = TraceRecorder(directory, rank, 3)
        late = LATE_S if rank == slow else 0.0
        for step in range(1, steps + 1):
            start = 100.0 + step * 0.2 + 0.0003 * rank
            stats = _stats(step, start, late)
            recorder.record_step(step, stats, start - 0.01, start + 0.06)
        recorder.write()
        rows = [_stats(s, 0.0, late) for s in range(1, steps + 1)]
        ready.append([[b.ready for b in r.buckets] for r in rows])
        end.append([max(b.done for b in r.buckets) for r in rows])
    return torch.tensor(ready, dtype=torch.float64), torch.tensor(end, dtype=torch.float64)


def test_straggler_from_trace_files_matches_the_live_analysis(tmp_path):
    ready, end = _write(tmp_path, [0, 1, 2], slow=2)
    report = trace_stragglers(load_events(tmp_path))
    oracle = analyze(ready, end, 1, 6)
    assert (report.rank, report.bucket) == (oracle.rank, oracle.bucket) == (2, 1)
    assert report.wait_seconds == pytest.approx(oracle.wait_seconds, abs=2e-6)
    assert report.wait_seconds == pytest.approx(LATE_S, abs=2e-6)
    assert "rank 2 made the others wait 30.0 ms at bucket 1" in report.describe()


def test_node_report_merges_its_ranks_draws_and_names_the_straggler(tmp_path):
    _write(tmp_path, [2, 3], slow=3)  # node 1 of a job with 2 ranks per node
    lines, merged = report_trace(tmp_path, [2, 3], suffix="_node1")
    assert merged
    assert f"trace: {tmp_path / 'trace_node1.json'}" in lines[0]
    assert (tmp_path / "timeline_node1.png").read_bytes()[:8] == PNG
    assert "rank 3 made the others wait" in lines[-1]
    assert {e["pid"] for e in load_events(tmp_path / "trace_node1.json")} == {2, 3}
    lines, merged = report_trace(tmp_path / "none", [0, 1])
    assert not merged and "no file from rank(s) [0, 1]" in lines[0]


def test_trace_merge_joins_nodes_directories(tmp_path, capsys):
    _write(tmp_path / "node0", [0, 1], slow=-1)
    _write(tmp_path / "node1", [2, 3], slow=-1)
    out = tmp_path / "all.json"
    argv = ["trace", "merge", str(tmp_path / "node0"), str(tmp_path / "node1"), "-o", str(out)]
    assert cli_main(argv) == 0
    assert {e["pid"] for e in load_events(out)} == {0, 1, 2, 3}
    _write(tmp_path / "again", [1], slow=-1)
    with pytest.raises(ValueError, match="rank 1 is in both"):
        join_traces([tmp_path / "node0", tmp_path / "again"], out)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["trace", "merge", str(tmp_path / "node0"), str(tmp_path / "again")])
    assert exit_.value.code == 2
    assert "rank 1 is in both" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_bad_flush_interval_is_named(value):
    with pytest.raises(EnvironmentConfigError, match=f"LOCKSTEP_TRACE_FLUSH_S={value!r}"):
        read_trace_flush_s({"LOCKSTEP_TRACE_FLUSH_S": value})
    assert read_trace_flush_s({}) == 5.0
