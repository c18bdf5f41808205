"""The observe layer's pure parts: metrics arithmetic, straggler analysis, trace files, pictures.

Engine figures are written out by hand (`StepStats` is plain data), so every
expected value below is worked out from them directly.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from lockstep.cli import main as cli_main
from lockstep.env import read_trace_dir
from lockstep.observe import (
    ReplicaCheck,
    TraceRecorder,
    analyze,
    load_events,
    measure,
    merge_traces,
    parameter_checksum,
    plot_loss,
    plot_timeline,
    summarize,
)
from lockstep.observe.logger import ConsoleLog, format_line
from lockstep.observe.plot import read_losses
from lockstep.runtime.step_stats import BucketRecord, StepStats

PNG = b"\x89PNG\r\n\x1a\n"


def _stats(step: int, start: float, exposed: float = 0.002) -> StepStats:
    buckets = (
        BucketRecord(0, 4000, 2, ready=0.010, launched=0.010, done=0.016),
        BucketRecord(1, 8000, 3, ready=0.014, launched=0.016, done=0.024),
    )
    return StepStats(
        step=step,
        world_size=2,
        forward_seconds=0.005,
        backward_seconds=0.017,
        payload_bytes=12000,
        wire_bytes=12000,
        comm_seconds=0.014,
        exposed_seconds=exposed,
        buckets=buckets,
        start=start,
    )


def test_measure_joins_engine_and_loop_figures():
    m = measure(
        _stats(1, 100.0),
        step=7,
        samples=64,
        step_seconds=0.032,
        data_seconds=0.003,
        optimizer_seconds=0.004,
    )
    assert (m.step, m.samples, m.synced) == (7, 64, True)
    assert m.bucket_seconds == pytest.approx((0.006, 0.008))
    assert m.comm_span_seconds == pytest.approx(0.014)
    assert m.overlap == pytest.approx(1 - 0.002 / 0.014)
    assert m.samples_per_second == pytest.approx(64 / 0.032)
    assert json.loads(json.dumps(m.to_dict()))["bucket_seconds"] == pytest.approx([0.006, 0.008])
    idle = measure(
        None, step=8, samples=64, step_seconds=0.01, data_seconds=0.0, optimizer_seconds=0.0
    )
    assert not idle.synced and idle.wire_bytes == 0 and idle.bucket_seconds == ()


def test_summarize_weights_overlap_by_span_and_throughput_by_wall_time():
    a = measure(
        _stats(1, 0.0, exposed=0.000),
        step=1,
        samples=10,
        step_seconds=0.1,
        data_seconds=0,
        optimizer_seconds=0,
    )
    b = measure(
        _stats(2, 1.0, exposed=0.007),
        step=2,
        samples=10,
        step_seconds=0.3,
        data_seconds=0,
        optimizer_seconds=0,
    )
    s = summarize([replace(a, loss=2.0), replace(b, loss=4.0)])
    assert s.step == 2 and s.steps == 2 and s.loss == 3.0
    assert s.samples_per_second == pytest.approx(20 / 0.4)
    assert s.ms_per_step == pytest.approx(200.0)
    assert s.overlap == pytest.approx(1 - 0.007 / 0.028)
    line = format_line(s, total_steps=10)
    assert "2/10" in line and "loss 3.0000" in line and "overlap  75%" in line
    with pytest.raises(ValueError, match="at least one step"):
        summarize([])


def _absolute_to_relative(start, ready_abs, comm):
    """Each rank's view: times from its own start; the all-reduce ends at one instant."""
    end_abs = ready_abs.max(dim=0).values[:, -1] + comm  # [steps]
    return ready_abs - start.unsqueeze(-1), end_abs.unsqueeze(0) - start


def test_analyze_names_the_rank_that_is_ready_last():
    gen = torch.Generator().manual_seed(0)
    ranks, steps, buckets = 3, 6, 4
    start = torch.rand(ranks, steps, generator=gen, dtype=torch.float64) * 1e-4
    rel = torch.linspace(0.01, 0.04, buckets, dtype=torch.float64).expand(ranks, steps, -1)
    ready_abs = start.unsqueeze(-1) + rel + 1e-4 * torch.rand(ranks, steps, buckets, generator=gen)
    ready_abs[2, :, 1:] += 0.030  # rank 2 slow from bucket 1 on
    ready, end = _absolute_to_relative(start, ready_abs, 0.002)
    report = analyze(ready, end, 11, 16)
    assert (report.rank, report.first_step, report.last_step) == (2, 11, 16)
    assert report.wait_seconds == pytest.approx(0.030, abs=3e-4)
    assert report.bucket >= 1 and report.last_share == 1.0 and report.significant
    assert "rank 2 made the others wait" in report.describe()


def test_analyze_catches_a_rank_that_starts_late():
    steps = 4
    start = torch.zeros(2, steps, dtype=torch.float64)
    start[0] += 0.050  # rank 0's data loading: its whole step starts 50 ms later
    rel = torch.tensor([0.010, 0.020], dtype=torch.float64).expand(2, steps, -1)
    ready, end = _absolute_to_relative(start, start.unsqueeze(-1) + rel, 0.001)
    assert torch.allclose(ready[0], ready[1])  # step-relative times alone see nothing
    report = analyze(ready, end, 1, steps)
    assert report.rank == 0 and report.wait_seconds == pytest.approx(0.050)
    balanced = analyze(ready, end[1].expand(2, -1), 1, steps)
    assert not balanced.significant and "ranks in step" in balanced.describe()


def _write_traces(directory, ranks=2, steps=3, keep=100):
    for rank in range(ranks):
        rec = TraceRecorder(directory, rank, ranks, max_steps=keep)
        for step in range(1, steps + 1):
            start = 10.0 + step * 0.1 + rank * 0.001
            stats = _stats(step, start)
            m = measure(
                stats,
                step=step,
                samples=8,
                step_seconds=0.05,
                data_seconds=0.001,
                optimizer_seconds=0.003,
            )
            rec.record(m, stats, start - 0.001, start + 0.05, (start + 0.04, start + 0.043))
        rec.write()


def test_trace_files_hold_every_bucket_and_merge(tmp_path):
    _write_traces(tmp_path)
    events = json.loads((tmp_path / "trace_rank1.json").read_text())["traceEvents"]
    step2 = [e for e in events if e.get("args", {}).get("step") == 2]
    cats = sorted(e["cat"] for e in step2)
    assert cats == sorted(
        ["step", "data", "forward", "backward", "exposed", "optimizer"] + ["ready", "allreduce"] * 2
    )
    comm = {e["args"]["bucket"]: e for e in step2 if e["cat"] == "allreduce"}
    assert comm[1]["dur"] == pytest.approx(8000.0) and comm[0]["dur"] == pytest.approx(6000.0)
    assert comm[1]["tid"] != comm[0]["tid"] != 0  # one track per bucket, compute on 0
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert {"rank 1", "compute", "bucket 0", "bucket 1"} <= names
    merged = merge_traces(tmp_path)
    assert {e["pid"] for e in load_events(merged)} == {0, 1}
    assert len(load_events(tmp_path)) == len(load_events(merged))


def test_trace_keeps_only_the_last_steps(tmp_path):
    _write_traces(tmp_path, ranks=1, steps=5, keep=2)
    steps = {e["args"]["step"] for e in load_events(tmp_path) if "step" in e.get("args", {})}
    assert steps == {4, 5}
    with pytest.raises(ValueError, match="at least 1"):
        TraceRecorder(tmp_path, 0, 1, max_steps=0)


def test_trace_cli_merges_and_plots(tmp_path, capsys):
    _write_traces(tmp_path / "t")
    out = tmp_path / "all.json"
    assert cli_main(["trace", "merge", str(tmp_path / "t"), "-o", str(out)]) == 0
    png = tmp_path / "timeline.png"
    assert cli_main(["trace", "plot", str(out), "-o", str(png), "--steps", "2"]) == 0
    assert png.read_bytes()[:8] == PNG
    assert plot_timeline(tmp_path / "t", tmp_path / "dir.png").read_bytes()[:8] == PNG
    with pytest.raises(SystemExit) as exit_:
        cli_main(["trace", "merge", str(tmp_path / "nothing")])
    assert exit_.value.code == 2
    assert "trace_rank<N>.json" in capsys.readouterr().err


def test_loss_curve_keeps_the_last_record_of_a_step(tmp_path):
    lines = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5},
        {"event": "straggler"},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": None},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_losses(path) == {1: 3.0, 2: 2.0}
    assert plot_loss(path, tmp_path / "loss.png").read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="does not exist"):
        read_losses(tmp_path / "missing.jsonl")


def test_console_prints_lines_and_no_bar_off_a_terminal():
    stream = io.StringIO()
    log = ConsoleLog(total_steps=4, stream=stream)
    assert log.bar is None or log.bar.disable  # StringIO is not a terminal
    log.step()
    log.line("hello")
    log.close()
    assert stream.getvalue() == "hello\n"


def test_trace_directory_comes_from_the_environment():
    assert read_trace_dir({"LOCKSTEP_TRACE": "/tmp/t"}) == "/tmp/t"
    assert read_trace_dir({"LOCKSTEP_TRACE": ""}) is None and read_trace_dir({}) is None


def test_checksum_tells_identical_from_different_parameters():
    torch.manual_seed(0)
    a = nn.Linear(4, 3)
    torch.manual_seed(0)
    b = nn.Linear(4, 3)
    assert parameter_checksum(a) == parameter_checksum(b)
    with torch.no_grad():
        b.bias[0] = torch.nextafter(b.bias[0], torch.tensor(math.inf))  # one float32 ulp
    assert parameter_checksum(a) != parameter_checksum(b)
    same = ReplicaCheck(("ab", "ab"))
    differ = ReplicaCheck(("ab", "ab", "cd"))
    assert same.identical and "2/2" in same.describe()
    assert not differ.identical and "[2]" in differ.describe()


def test_tensorboard_scalars_read_back_by_tensorboard(tmp_path):
    # tensorboard is a dev dependency: this test runs, it never skips.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lockstep.observe.logger import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    for step, loss in ((1, 3.5), (2, 2.5)):
        m = measure(
            _stats(step, 0.0),
            step=step,
            samples=8,
            step_seconds=0.05,
            data_seconds=0.0,
            optimizer_seconds=0.001,
        )
        sink.write(replace(m, loss=loss))
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [(1, 3.5), (2, 2.5)]
    overlap = events.Scalars("comm/overlap")[0].value
    assert overlap == pytest.approx(1 - 0.002 / 0.014, rel=1e-6)


def test_monitor_rejects_bad_input_with_a_clear_message():
    from lockstep import DistContext, Monitor

    ctx = DistContext(0, 0, 1, 1, 0, "gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"expected a lockstep\.DistributedDataParallel"):
        Monitor(nn.Linear(2, 2), ctx)
    with pytest.raises(ValueError, match="log_every >= 1"):
        Monitor(nn.Linear(2, 2), ctx, log_every=0)
