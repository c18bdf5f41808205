"""The flagship demo (examples/gpt_demo.py) end to end, shrunk: 4 steps, then a resume.

Its `main()` runs twice inside two spawned gloo ranks (the code `lockstep run`
starts), on 100 kB of standard-library text: both runs must end with identical
replicas (exit code 0) and leave every picture and file the demo promises, and
the second must resume from the checkpoint of step 4 and continue at step 5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lockstep.testing import run_ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PNG = b"\x89PNG\r\n\x1a\n"


def _demo(ctx, out):
    sys.path.insert(0, str(EXAMPLES))
    import gpt_demo

    common = ["--max-bytes", "100000", "--log-every", "2", "--out", out]
    first = gpt_demo.main(["--steps", "4", *common])
    resumed = gpt_demo.main(["--steps", "2", *common])  # a re-run: resumes at step 4
    return first, resumed


@pytest.mark.slow  # the whole demo, twice
def test_demo_trains_draws_checks_replicas_and_resumes(tmp_path):
    out = tmp_path / "run"
    # rank 0 draws the pictures after the first run while rank 1 starts the second and
    # waits for it in the wrap's first collective: seconds on a loaded machine
    assert run_ranks(_demo, 2, str(out), timeout_s=60, deadline_s=150) == [(0, 0), (0, 0)]
    for name in ("timeline.png", "loss.png"):
        assert (out / name).read_bytes()[:8] == PNG
    merged = json.loads((out / "trace" / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    steps = {e["args"]["step"] for e in merged if "step" in e.get("args", {})}
    assert steps == {5, 6}  # the second run's trace
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 for r in records if "event" not in r)
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*.pt"))
    assert checkpoints == ["step_00000004.pt", "step_00000006.pt"]
