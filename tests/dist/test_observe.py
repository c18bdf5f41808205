"""Monitor on two real gloo ranks: metrics agree with the engine, logs, JSONL and the trace.

One spawned run trains a small MLP split into several buckets for four steps
with a Monitor (trace directory from LOCKSTEP_TRACE) and returns what each
rank saw; the checks compare the metrics with the engine's own stats and with
the ring's bytes figured from the model's gradients, the JSONL losses with the
ranks' losses, and the trace events with the bucket records, one by one.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import torch
from engine_models import MLP

import lockstep
from lockstep.observe import plot_timeline
from lockstep.testing import run_ranks

STEPS, BATCH = 4, 6


def _train(ctx, out):
    torch.manual_seed(0)
    ddp = lockstep.DistributedDataParallel(MLP(64), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    stream = io.StringIO()
    monitor = lockstep.Monitor(
        ddp,
        ctx,
        optimizer=opt,
        log_every=2,
        log_dir=out,
        straggler_every=0,
        stream=stream,
        tensorboard=True,
    )
    gen = torch.Generator().manual_seed(10 + ctx.rank)
    metrics, stats, losses = [], [], []
    for _ in range(STEPS):
        loss = ddp(torch.randn(BATCH, 8, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metrics.append(monitor.step(loss, batch_size=BATCH))
        stats.append(ddp.stats)
        losses.append(loss.item())
    merged = monitor.close()
    return {
        "metrics": metrics,
        "stats": stats,
        "losses": losses,
        "payload": ddp.payload_bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
        "printed": stream.getvalue(),
        "merged": str(merged) if merged else None,
    }


def test_monitor_metrics_logs_and_trace(tmp_path):
    trace_dir = tmp_path / "trace"
    results = run_ranks(_train, 2, str(tmp_path), env={"LOCKSTEP_TRACE": str(trace_dir)})
    for result in results:
        _check_metrics(result)
    _check_logs(results, tmp_path)
    for rank, result in enumerate(results):
        _check_trace(trace_dir, rank, result)
    merged = json.loads(Path(results[0]["merged"]).read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    png = plot_timeline(results[0]["merged"], tmp_path / "timeline.png", steps=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_metrics(result):
    assert result["payload"] == result["param_bytes"]
    for m, s in zip(result["metrics"], result["stats"], strict=True):
        assert m.synced and m.samples == 2 * BATCH
        assert m.payload_bytes == result["payload"]
        # A ring sends 2(N-1)/N times the gradient bytes, counted from the model: 1x at N = 2.
        assert m.wire_bytes == 2 * (2 - 1) / 2 * result["param_bytes"]
        assert 0.0 <= m.overlap <= 1.0 and m.overlap == s.overlap
        assert len(m.bucket_seconds) == len(s.buckets) >= 3
        assert math.isclose(sum(m.bucket_seconds), m.comm_seconds, rel_tol=1e-9)
        assert m.optimizer_seconds > 0
        inside = m.forward_seconds + m.backward_seconds + m.exposed_seconds
        assert m.step_seconds >= inside + m.optimizer_seconds
        assert m.samples_per_second == m.samples / m.step_seconds
    assert [m.step for m in result["metrics"]] == list(range(1, STEPS + 1))


def _check_logs(results, out):
    lines = results[0]["printed"].splitlines()
    assert [line.split()[1] for line in lines] == ["2", "4"]
    assert all("ms/step" in line and "samples/s" in line and "overlap" in line for line in lines)
    assert results[1]["printed"] == ""  # only rank 0 speaks
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for i, record in enumerate(records):
        expected = (results[0]["losses"][i] + results[1]["losses"][i]) / 2
        assert math.isclose(record["loss"], expected, rel_tol=1e-6)
        assert record["wire_bytes"] == results[0]["metrics"][i].wire_bytes
    _check_tensorboard(out, records, results[0]["metrics"])


def _check_tensorboard(out, records, metrics):
    """What `tensorboard --logdir` shows, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list(out.glob("events.out.tfevents.*"))) == 1  # rank 0's only
    events = EventAccumulator(str(out))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [s.step for s in losses] == [r["step"] for r in records]
    for scalar, record in zip(losses, records, strict=True):
        assert math.isclose(scalar.value, record["loss"], rel_tol=1e-6)  # stored as float32
    step_ms = [s.value for s in events.Scalars("time/step_ms")]
    for value, m in zip(step_ms, metrics, strict=True):
        assert math.isclose(value, 1e3 * m.step_seconds, rel_tol=1e-6)


def _check_trace(trace_dir, rank, result):
    document = json.loads((trace_dir / f"trace_rank{rank}.json").read_text())
    events = document["traceEvents"]
    assert document["otherData"] == {"rank": rank, "world_size": 2}
    for step, stats in enumerate(result["stats"], start=1):
        mine = [e for e in events if e.get("args", {}).get("step") == step]
        names = [e["name"] for e in mine if e["cat"] in ("forward", "backward", "optimizer")]
        assert sorted(names) == ["backward", "forward", "optimizer"]
        for b in stats.buckets:
            ready = [e for e in mine if e["cat"] == "ready" and e["args"]["bucket"] == b.index]
            comm = [e for e in mine if e["cat"] == "allreduce" and e["args"]["bucket"] == b.index]
            assert len(ready) == 1 and len(comm) == 1
            assert comm[0]["ph"] == "X" and ready[0]["ph"] == "i"
            assert math.isclose(comm[0]["dur"], (b.done - b.launched) * 1e6, abs_tol=0.01)
            assert (
                comm[0]["ts"] - ready[0]["ts"] >= (b.launched - b.ready) * 1e6 - 1.0
            )  # ts: µs since 1970
            assert comm[0]["args"]["bytes"] == b.nbytes
