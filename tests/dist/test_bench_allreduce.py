"""`lockstep bench allreduce` launched like training at world size 2, and its JSON fed to plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from lockstep.cli import main


def _run_bench(args: list[str], timeout_s: float = 200) -> subprocess.CompletedProcess:
    """Run the command in its own session, so a timeout kills the launcher and its workers."""
    cmd = [sys.executable, "-m", "lockstep.cli", "bench", "allreduce", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sweep_at_world_size_2_writes_json_that_plan_accepts(tmp_path, capsys):
    path = tmp_path / "bw.json"
    args = ["--nproc-per-node", "2", "--min-bytes", "4KiB", "--max-bytes", "64KiB"]
    proc = _run_bench([*args, "--iters", "3", "--warmup", "1", "--json", str(path)])
    assert proc.returncode == 0, proc.stderr
    assert "busbw" in proc.stdout and "algbw" in proc.stdout

    doc = json.loads(path.read_text())
    n = doc["world_size"]
    assert n == 2 and doc["backend"] == "gloo"
    assert [row["size_bytes"] for row in doc["rows"]] == [4096, 8192, 16384, 32768, 65536]
    for row in doc["rows"]:
        assert row["wrong"] == 0  # the sum of ranks arrived in every element
        assert row["count"] == row["size_bytes"] // 4 and row["type"] == "fp32"
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        assert row["algbw_GBps"] == pytest.approx(algbw)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (n - 1) / n)
    slowdown = doc["overlap_slowdown"]  # the same all-reduce idle and while ranks compute
    assert slowdown["factor"] >= 1.0 and slowdown["idle_s"] > 0 and slowdown["busy_s"] > 0
    # the table lines carry the same figures as the JSON
    table_sizes = [int(line.split()[0]) for line in proc.stdout.splitlines() if line[:1] == " "]
    assert table_sizes == [row["size_bytes"] for row in doc["rows"]]

    assert main(["plan", "--model", "gpt2", "--gpus", "2", "--bandwidth-from", str(path)]) == 0
    assert "measured" in capsys.readouterr().out
    assert (
        main(
            ["plan", "--model", "gpt2", "--gpus", "2", "--bandwidth-from", str(path), "--json", "-"]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    measured = [row for row in plan["allreduce"] if row["label"] == "measured"]
    assert len(measured) == 1 and measured[0]["seconds_fast"] > 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--min-bytes", "0"], "--min-bytes must be at least 1 byte"),
        (["--min-bytes", "64KiB", "--max-bytes", "4KiB"], "must not exceed --max-bytes"),
        (["--min-bytes", "2"], "--min-bytes must hold at least one element (4 bytes)"),
        (["--max-bytes", "lots"], "--max-bytes expects a number with a unit"),
        (["--iters", "0"], "--iters must be at least 1"),
        (["--dtype", "fp8"], "--dtype expects one of fp32, fp16, bf16"),
        (["--factor", "1"], "--factor must be an integer >= 2"),
        (["--backend", "nccl"], "--backend nccl needs CUDA devices"),
    ],
)
def test_bad_sweep_flags_fail_before_any_worker_starts(capsys, args, expected):
    if args[:2] == ["--backend", "nccl"] and torch.cuda.is_available():
        pytest.skip("CUDA is visible: nccl is a valid backend here")
    with pytest.raises(SystemExit) as info:
        main(["bench", "allreduce", "--nproc-per-node", "2", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockstep bench: error: ") and "\n" not in err
    assert expected in err
