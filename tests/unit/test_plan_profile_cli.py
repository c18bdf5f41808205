"""`lockstep plan --profile` end to end on a tiny model, and its bad input (exit code 2)."""

from __future__ import annotations

import json
import re
import textwrap
from types import SimpleNamespace

import pytest

from lockstep.cli import main
from lockstep.observe.trace import TraceRecorder
from lockstep.runtime.step_stats import BucketRecord, StepStats

TINY = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50))

    def conv():
        return nn.Sequential(nn.Conv2d(3, 4, 3))

    def hook(batch_size):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
        return model, torch.randn(batch_size, 3, 8, 8), lambda out: out.sum()

    def bad_hook(batch_size):
        return "model"
    """
)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    (tmp_path / "tinymodels.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "--json", "-", "--profile-steps", "2", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_profile_predicts_a_step_that_adds_up(tiny, capsys):
    args = ["--model", "tinymodels:build", "--gpus", "4", "--weights-dtype", "fp32"]
    doc = _plan_json(
        capsys,
        *args,
        "--profile",
        "tinymodels:build",
        "--link",
        "1MB/s",
        "--comm-slowdown",
        "1.5",
        "--timeline",
        str(tiny / "pred.png"),
    )
    step, pred = doc["step"], doc["step"]["prediction"]
    assert step["profile"]["payload_bytes"] == doc["payload_bytes"]
    assert step["slowdown"]["factor"] == 1.5
    # 1 MB/s: the communication cannot hide, so the step waits for it.
    assert pred["exposed_s"] > 0 and pred["critical_bucket"] is not None
    total = pred["forward_s"] + pred["backward_s"] + pred["exposed_s"] + pred["optimizer_s"]
    assert pred["step_s"] == pytest.approx(total)
    assert pred["buckets"][-1]["done_s"] == pytest.approx(
        pred["forward_s"] + pred["backward_s"] + pred["exposed_s"]
    )
    assert sum(b["bytes"] for b in pred["buckets"]) == doc["payload_bytes"]
    assert (tiny / "pred.png").stat().st_size > 0 and (tiny / "pred.trace.json").exists()
    rows = {(c["row"], c["column"]) for c in step["scaling"]}
    assert ("nvlink + ethernet|two-phase", "N=1024") in rows and ("nvlink|ring", "N=16") not in rows
    strategies = {c["row"] for c in step["strategies"]["cells"]}
    assert {"DDP, full fine-tune", "ZeRO-1/2, full fine-tune", "ZeRO-3, full fine-tune"} <= (
        strategies
    )


def test_table_names_the_prediction_and_lora_row(tiny, capsys):
    args = ["--model", "tinymodels:build", "--gpus", "2", "--profile", "tinymodels:build"]
    assert main(["plan", *args, "--profile-steps", "1", "--lora-targets", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "step prediction (profile: tinymodels:build" in out
    assert "critical path" in out and "overlap" in out
    assert "DDP, LoRA r=8" in out


def test_model_defaults_to_the_profiled_one(tiny, capsys):
    args = ["--gpus", "2", "--profile", "tinymodels:build", "--weights-dtype", "fp32"]
    doc = _plan_json(capsys, *args)
    assert doc["model"]["label"] == "tinymodels:build"
    assert doc["payload_bytes"] == doc["step"]["profile"]["payload_bytes"]
    with pytest.raises(SystemExit) as info:
        main(["plan", "--gpus", "2"])
    assert info.value.code == 2 and "--model is required" in capsys.readouterr().err


def test_profile_script_hook_builds_its_own_batch(tiny, capsys):
    doc = _plan_json(capsys, "--model", "7B", "--gpus", "2", "--profile-script", "tinymodels:hook")
    assert doc["step"]["profile"]["payload_bytes"] == 4 * (4 * 3 * 3 * 3 + 4)


def test_measured_link_brings_its_slowdown(tiny, capsys):
    bench = {
        "format": "lockstep.bench.allreduce/1",
        "world_size": 2,
        "fit": {"busbw_GBps": 0.5, "hop_latency_us": 100.0},
        "overlap_slowdown": {"factor": 1.7},
    }
    (tiny / "bw.json").write_text(json.dumps(bench))
    doc = _plan_json(
        capsys,
        "--model",
        "tinymodels:build",
        "--gpus",
        "2",
        "--profile",
        "tinymodels:build",
        "--bandwidth-from",
        "bw.json",
    )
    assert doc["step"]["slowdown"] == {"factor": 1.7, "source": "measured, bw.json"}
    assert doc["step"]["route"]["label"] == "measured"


def test_trace_of_a_real_run_keeps_its_buckets(tiny, capsys):
    recorder = TraceRecorder(tiny / "trace", rank=0, world_size=2)
    buckets = (
        BucketRecord(0, 4000, 2, 0.030, 0.030, 0.031),
        BucketRecord(1, 9000, 3, 0.050, 0.050, 0.052),
    )
    for step in (1, 2, 3):
        stats = StepStats(step, 2, 0.010, 0.040, 13000, 13000, 0.003, 0.002, buckets, 10.0 * step)
        recorder.record(
            SimpleNamespace(step=step),
            stats,
            10.0 * step,
            10.0 * step + 0.06,
            (10.0 * step + 0.052, 10.0 * step + 0.06),
        )
    recorder.write()
    doc = _plan_json(
        capsys,
        "--model",
        "7B",
        "--gpus",
        "2",
        "--link",
        "1GB/s",
        "--profile-trace",
        "trace",
        "--comm-slowdown",
        "1",
    )
    pred = doc["step"]["prediction"]
    assert [b["bytes"] for b in pred["buckets"]] == [4000, 9000]
    # bucket 1 is ready at 50 ms, the end of backward; a ring without latency at 1 GB/s: 9 us
    assert pred["buckets"][1]["ready_s"] == pytest.approx(0.050)
    assert pred["exposed_s"] == pytest.approx(9000 / 1e9, rel=1e-3)
    assert doc["step"]["profile"]["prebucketed"] is True


def _error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "7B", "--gpus", "2", *args])
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--profile", "tinymodels:build", "--profile-trace", "x"], r"give one of --profile"),
        (["--profile-trace", "no/such/dir"], r"expected a trace file or directory"),
        (["--profile", "tinymodels:conv"], r"neither nn.Embedding nor nn.Linear.*--profile-script"),
        (["--profile-script", "tinymodels:bad_hook"], r"returned str; expected pkg.module:fn"),
        (["--profile", "tinymodels:nothing"], r"has no attribute 'nothing'"),
        (["--profile", "tinymodels:build", "--comm-slowdown", "0.5"], r"must be >= 1.0"),
        (["--profile", "tinymodels:build", "--profile-steps", "0"], r"--profile-steps must be"),
    ],
)
def test_bad_profile_input_fails_with_one_line(tiny, capsys, args, expected):
    assert re.search(expected, _error(capsys, *args))
