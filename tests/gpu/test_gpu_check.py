"""The CPU-testable parts of `make gpu-check`: torch-version skips and the table.

A DDP argument the installed torch lacks must turn a comparison into a skip that
names it (the GPU machines carry torch 2.11, lockstep follows 2.13); the runner's
table must count each test function's outcomes and show the first failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ddp_cases
import pytest
import torch
from ddp_cases import Case, skip_reason
from gpu_check import render, summarise_junit

from lockstep.testing.torch_features import (
    absent_from_installed_torch,
    ddp_arguments,
    missing_ddp_arguments,
)


def test_arguments_are_read_from_the_installed_signature():
    assert {"static_graph", "gradient_as_bucket_view", "find_unused_parameters"} <= ddp_arguments()
    assert missing_ddp_arguments(["static_graph", "no_such_argument"]) == ["no_such_argument"]


def test_on_torch_2_13_nothing_lockstep_follows_is_absent():
    if not torch.__version__.startswith("2.13"):
        pytest.skip(f"torch {torch.__version__}: the list is that version's own")
    assert absent_from_installed_torch() == []


def test_a_case_with_an_argument_torch_lacks_skips_and_says_which(monkeypatch):
    monkeypatch.setitem(ddp_cases.CASES, "future", Case({"an_argument_of_torch_3": True}))
    reason = skip_reason("future", "cpu")
    assert reason is not None and "an_argument_of_torch_3" in reason
    assert torch.__version__ in reason
    assert skip_reason("static_graph", "cpu") is None


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.gpu.test_a" name="test_x[cpu-1]"/>
<testcase classname="tests.gpu.test_a" name="test_x[cuda-1]"><skipped message="no CUDA"/></testcase>
<testcase classname="tests.gpu.test_a" name="test_x[cpu-2]">
<failure message="differs by 0.5&#10;more"/></testcase>
<testcase classname="tests.gpu.test_b" name="test_y"/>
</testsuite></testsuites>"""


def test_the_table_counts_outcomes_per_test_function_and_shows_the_failure():
    rows = summarise_junit(JUNIT)
    assert rows == [
        ("test_a::test_x", "FAIL 1 passed, 1 failed, 1 skipped", "differs by 0.5"),
        ("test_b::test_y", "1 passed", ""),
    ]
    table = render([("check", "result", "detail"), *rows]).splitlines()
    assert len(table) == 4 and table[2].startswith("test_a::test_x")


@pytest.mark.slow
@pytest.mark.soak  # half a minute each: make soak, and every GPU session's make gpu-check
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["gpu_memory.py", "gpu_vs_torch.py"])
def test_the_gpu_benchmarks_run_on_cpu_at_smoke_size(script, tmp_path):
    """`--smoke --device cpu` runs each benchmark to its table: a GPU session finds it whole."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(root / "benchmarks" / script), "--smoke", "--device", "cpu"]
    done = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert out.exists() and json.loads(out.read_text()), done.stdout[-2000:]
